#!/usr/bin/env python3
"""Transformers `Trainer` with FSDP2 (through accelerate) publishing every step with Stitch.

    torchrun --nproc-per-node 2 examples/hf_trainer_fsdp.py [--dir ./stitch-hf-fsdp-demo]
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 examples/hf_trainer_fsdp.py

A tiny Llama built locally (no hub), `fsdp=True, fsdp_config={"version": 2}` (accelerate shards it
in place with `fully_shard`), AdamW. `StitchCallback` drives an `FSDPPublisher` on every rank:
v0 is the starting checkpoint, then after every optimizer step each rank diffs and uploads its own
shard (no weight is gathered). At the end the main process pulls the last version (as
`stitch pull` would) and checks it against the trained weights' bf16 view.

On the CPU, accelerate (1.15) ignores the FSDP plugin (it enables FSDP only on accelerator
devices, and the Trainer falls back to DDP); `allow_fsdp_on_cpu` applies accelerate's own FSDP
branch to the CPU so the example runs on a laptop with gloo. On GPUs it is not used.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path

import torch

RUN = "hf-fsdp-demo"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32, vocab: int = 512):
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def allow_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP plugin take effect on MULTI_CPU (gloo), as it does on MULTI_GPU."""
    import accelerate.state as st
    from accelerate.utils import DistributedType

    init = st.AcceleratorState.__init__

    def patched(self, *a, fsdp_plugin=None, **k):
        init(self, *a, fsdp_plugin=fsdp_plugin, **k)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = DistributedType.FSDP
            st.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    st.AcceleratorState.__init__ = patched


def main() -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from stitch_trainer.fsdp import FSDPPublisher
    from stitch_trainer.hf import StitchCallback

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./stitch-hf-fsdp-demo")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    work = Path(a.dir).resolve()
    cpu = not torch.cuda.is_available()
    if cpu:
        torch.set_num_threads(1)
        allow_fsdp_on_cpu()
    args = TrainingArguments(
        output_dir=str(work / "out"),
        max_steps=a.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        optim="adamw_torch",
        use_cpu=cpu,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )  # also initialises the process group (gloo on the CPU, NCCL on GPUs)
    rank = dist.get_rank()
    ckpt = work / "start"
    if rank == 0:  # the checkpoint training starts from (normally: your model directory)
        shutil.rmtree(work, ignore_errors=True)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(ckpt)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)

    pub = FSDPPublisher(str(work / "board"), RUN, "bf16", config_dir=ckpt)
    cb = StitchCallback(pub, start_from=ckpt, close_on_end=True)  # v0 = ckpt, on train begin
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    final = trainer.accelerator.get_state_dict(trainer.model)  # collective: for the check only
    if rank == 0:
        from torch.distributed.tensor import DTensor

        sharded = all(isinstance(p, DTensor) for p in trainer.model.parameters())
        print(
            f"trained {type(trainer.model).__name__} on {dist.get_world_size()} ranks "
            f"(FSDP2: {trainer.accelerator.is_fsdp2}, DTensor parameters: {sharded})"
        )
        for info in cb.published:
            m = info.result()
            print(
                f"step {m.step}: v{m.version} {len(m.patches)} parts, {m.patch_bytes:,} bytes, "
                f"{100 * m.changed_elements / m.total_elements:.1f}% changed, "
                f"publish took {info.blocked_seconds:.2f}s"
            )
        check(work, final)
    dist.destroy_process_group()


def check(work: Path, final: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    from stitch_core.format import dtypes
    from stitch_core.format.views import project
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull

    out = work / "pulled"
    m = asyncio.run(pull(LocalBoard(work / "board"), RUN, None, out, work / "cache", quiet=True))
    got = load_file(out / "model.safetensors")
    want = project({k: v for k, v in final.items() if k in got}, "bf16")
    same = got.keys() == want.keys() and all(
        torch.equal(dtypes.int_view(got[k]), dtypes.int_view(want[k])) for k in want
    )
    print(
        f"pulled v{m.version} (step {m.step}) to {out}: equals the trained weights' bf16 view: "
        f"{same}"
    )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
