"""The Transformers callback on a real `Trainer` run of a tiny Llama built locally (no hub)."""

from __future__ import annotations

import asyncio

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from stitch_core.format import fingerprint as fpr
from stitch_core.format.views import project
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_core.versions.store import list_manifests
from stitch_trainer import Publisher
from stitch_trainer.hf import StitchCallback
from stitch_trainer.publisher import named_tensors


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_trainer_callback_publishes_every_step_and_snapshot_loads(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    config.save_pretrained(tmp_path / "config")
    board = tmp_path / "board"
    pub = Publisher(str(board), "hf", "bf16", snapshot_every=4, config_dir=tmp_path / "config")
    cb = StitchCallback(pub)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6,
                             per_device_train_batch_size=4, learning_rate=1e-4,
                             report_to=[], save_strategy="no", use_cpu=True,
                             logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    pub.close()

    ms = asyncio.run(list_manifests(LocalBoard(board), "hf"))
    assert [m.step for m in ms] == [1, 2, 3, 4, 5, 6]
    assert [m.kind for m in ms] == ["snapshot", "patch", "patch", "patch", "snapshot", "patch"]
    final = project(named_tensors(model), "bf16")
    assert "lm_head.weight" not in final  # tied to the embeddings: dropped like HF checkpoints
    assert ms[-1].fingerprints == fpr.state_fingerprints(final)

    out = tmp_path / "pulled"
    asyncio.run(pull(LocalBoard(board), "hf", None, out, tmp_path / "cache", quiet=True))
    loaded = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    got = {k: v for k, v in loaded.state_dict().items() if k in final}
    assert got.keys() == final.keys()
    assert all(torch.equal(got[k].view(torch.int16), final[k].view(torch.int16)) for k in final)


SHARDED_CALLBACK = r"""
import os, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from stitch_trainer import Publisher
from stitch_trainer.hf import StitchCallback
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
pub = Publisher(sys.argv[1], "sharded", "bf16")
state = SimpleNamespace(global_step=1, is_world_process_zero=True)
try:
    StitchCallback(pub).on_step_end(None, state, None, model=model)
except RuntimeError as e:
    print("REFUSED:", e)
pub.close()
dist.destroy_process_group()
"""


def test_callback_refuses_a_gathering_publish_of_an_fsdp2_model(tmp_path):
    """On the main process alone, a plain Publisher would gather DTensors with collectives the
    other ranks never join (a hang on a real cluster): the callback refuses, naming the fix."""
    import subprocess
    import sys

    from stitch_dev.ports import free_port

    port = free_port()
    r = subprocess.run([sys.executable, "-c", SHARDED_CALLBACK, str(tmp_path / "b"), str(port)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED:" in r.stdout and "FSDPPublisher" in r.stdout
    assert not (tmp_path / "b" / "sharded" / "latest").exists()
