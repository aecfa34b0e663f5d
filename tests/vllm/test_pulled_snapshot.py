"""A version materialised by `stitch pull` loads in vLLM as is and serves exactly that version.

Publishing and pulling run in a subprocess, as a trainer and a `stitch pull` would.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from safetensors.torch import load_file, save_file

from stitch_dev.tinymodel import build_tiny_model

from .test_layout import PROMPTS, _engine, _generate, _shutdown

PUBLISH_AND_PULL = textwrap.dedent("""
    import asyncio, sys, torch
    from pathlib import Path
    from safetensors.torch import load_file
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_trainer import Publisher
    root, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    moved = load_file(root / "moved.safetensors")
    weights = load_file(model_dir / "model.safetensors")
    with Publisher(str(root / "board"), "vl", "bf16", config_dir=model_dir) as pub:
        pub.publish(0, {k: v.float() for k, v in weights.items()}).result()
        pub.publish(1, moved).result()
    asyncio.run(pull(LocalBoard(root / "board"), "vl", None, root / "pulled", root / "cache",
                     quiet=True))
""")


def test_pulled_version_loads_in_vllm_and_matches_a_direct_checkpoint(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2")
    weights = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    moved = {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).contiguous()
             for k, v in weights.items()}
    save_file(moved, tmp_path / "moved.safetensors")
    subprocess.run([sys.executable, "-c", PUBLISH_AND_PULL, str(tmp_path), str(model_dir)],
                   check=True, timeout=600)
    direct = build_tiny_model(tmp_path / "direct", arch="qwen2")  # same config and tokenizer
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in moved.items()},
              direct / "model.safetensors")
    llm = _engine(tmp_path / "pulled")
    got = _generate(llm)
    _shutdown(llm)
    llm = _engine(direct)
    want = _generate(llm)
    _shutdown(llm)
    assert len(got) == len(PROMPTS) and got == want
