"""StitchCallback + FSDPPublisher inside a real `transformers.Trainer` with FSDP2 from accelerate.

Two gloo processes on the CPU (launched like torchrun: MASTER_ADDR/PORT, WORLD_SIZE, RANK,
LOCAL_RANK) train a tiny Llama built here (tied embeddings, odd sizes: uneven shards) with
`fsdp=True, fsdp_config={"version": 2}` and AdamW, publishing every step. Every version must
equal, bit for bit, the bf16 view of the full weights gathered (for checking only) after that
step; the last one also the accelerator's full state dict at the end of training.

accelerate (1.15) enables its FSDP plugin only on accelerator devices: on the CPU it drops the
plugin silently and the Trainer runs DDP. The workers apply accelerate's own FSDP branch to the
CPU (`allow_fsdp_on_cpu`, see examples/hf_trainer_fsdp.py); the test asserts the model really was
sharded with FSDP2 so a silent fallback fails it.

The workers run this file as a script (`python tests/test_hf_accelerate_fsdp.py WORKDIR`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch

RUN = "hf-fsdp"
WORLD = 2
STEPS = 4
VOCAB = 255  # odd: embedding rows split 128 / 127
TIMEOUT = 120.0


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=97,  # odd: gate/up rows split 49 / 48
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16):
        self.x = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


# ---------------------------------------------------------------- worker (one per rank)


def allow_fsdp_on_cpu() -> None:
    """accelerate's AcceleratorState turns an FSDP plugin into `DistributedType.FSDP` only for
    MULTI_GPU/XPU/NPU/...: with MULTI_CPU it keeps no plugin and the Trainer wraps the model in
    DDP. Apply the same branch to MULTI_CPU (FSDP2's `fully_shard` itself runs on gloo)."""
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


def worker(work: Path) -> None:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from stitch_trainer import Publisher
    from stitch_trainer.fsdp import FSDPPublisher
    from stitch_trainer.hf import StitchCallback

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    allow_fsdp_on_cpu()
    report: dict = {"steps": []}

    def full_state(model) -> dict[str, torch.Tensor]:  # collective: every rank calls it
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts)

    class Recorder(TrainerCallback):  # after StitchCallback: sees the model it just published
        def on_train_begin(self, args, state, control, model=None, **kw):
            emb = model.model.embed_tokens.weight
            report["begin"] = {
                "class": type(model).__name__,
                "distributed_type": str(AcceleratorState().distributed_type),
                "is_fsdp2": AcceleratorState().is_fsdp2,
                "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
                "embed_local_rows": emb.to_local().shape[0] if isinstance(emb, DTensor) else -1,
                "tied": model.lm_head.weight is emb,
            }

        def on_step_end(self, args, state, control, model=None, **kw):
            report["steps"].append(state.global_step)
            full = full_state(model)
            if rank == 0:
                torch.save(full, work / f"full-{state.global_step}.pt")

    args = TrainingArguments(
        output_dir=str(work / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        optim="adamw_torch",
        use_cpu=True,
        seed=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    assert dist.is_initialized()  # TrainingArguments set up the gloo group: now the publisher
    model = LlamaForCausalLM.from_pretrained(work / "ckpt", dtype=torch.float32)
    pub = FSDPPublisher(str(work / "board"), RUN, "bf16", config_dir=work / "ckpt")
    cb = StitchCallback(pub, start_from=work / "ckpt", close_on_end=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, Recorder()])
    trainer.train()
    report["published"] = [[i.version, i.step, i.result().version] for i in cb.published]
    final = trainer.accelerator.get_state_dict(trainer.model)  # accelerate's full state dict
    if rank == 0:
        torch.save(final, work / "final.pt")

    # a plain Publisher under FSDP2 is refused by every rank before the first step (a refusal on
    # rank 0 alone would leave rank 1 waiting in the next step's all-gather)
    plain = Publisher(str(work / "board-plain"), "plain", "bf16")
    args.max_steps = 1
    again = Trainer(
        model=trainer.model, args=args, train_dataset=Tokens(), callbacks=[StitchCallback(plain)]
    )
    try:
        again.train()
        report["refused"] = None
    except RuntimeError as e:
        report["refused"] = str(e)
    plain.close()
    dist.barrier()
    (work / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent


def _launch(work: Path) -> None:
    """torchrun's environment for WORLD processes running this file; fail with their logs."""
    # the parent only (ranks run this file as a script, without the checkout on sys.path)
    from stitch_dev.ports import free_port
    from stitch_dev.ranks import rank_env, run_ranks

    base = rank_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                    HF_HUB_OFFLINE="1",  # nothing may be downloaded
                    TOKENIZERS_PARALLELISM="false")
    run_ranks(work, WORLD, lambda r: [sys.executable, __file__, str(work)],
              lambda r: {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, TIMEOUT, pytest.fail)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf-fsdp")
    build_model().save_pretrained(work / "ckpt")  # fp32 safetensors + config.json, tied
    _launch(work)
    return work, [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from stitch_core.format import dtypes

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(dtypes.int_view(a), dtypes.int_view(b))
    )


def _served(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 view of a gathered full state dict; the tied lm_head is published once (as the
    embeddings), as HF checkpoints store it."""
    from stitch_core.format.views import project

    full = dict(full)
    head = full.pop("lm_head.weight")
    assert torch.equal(head, full["model.embed_tokens.weight"])
    return project(full, "bf16")


def _pull(work: Path, version: int, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull

    m = asyncio.run(
        pull(LocalBoard(work / "board"), RUN, version, out, out.parent / "cache", quiet=True)
    )
    assert m.version == version
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def test_trainer_ran_fsdp2_through_accelerate(trained):
    _, reports = trained
    for r in reports:
        b = r["begin"]
        assert b["class"] == "FSDPLlamaForCausalLM" and b["all_dtensor"] and b["tied"], b
        assert b["distributed_type"] == "DistributedType.FSDP" and b["is_fsdp2"], b
        assert r["steps"] == list(range(1, STEPS + 1))
    assert [r["begin"]["embed_local_rows"] for r in reports] == [128, 127]  # really sharded


def test_every_step_published_on_every_rank(trained):
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import list_manifests

    work, reports = trained
    ms = asyncio.run(list_manifests(LocalBoard(work / "board"), RUN))
    assert [m.version for m in ms] == list(range(STEPS + 1))
    assert [m.step for m in ms] == list(range(STEPS + 1))  # v0: the checkpoint, at step 0
    assert [m.parent for m in ms] == [None, *range(STEPS)]
    assert ms[0].kind == "snapshot" and {o.path for o in ms[0].objects} >= {
        "model.safetensors",
        "config.json",
    }
    for m in ms[1:]:
        assert m.kind == "patch" and m.changed_elements > 0, m.version
        assert [o.path for o in m.patches] == ["part-00000.stp", "part-00001.stp"]
        assert "fsdp publisher (2 parts)" in m.producer
    want = [[v, v, v] for v in range(1, STEPS + 1)]
    assert [r["published"] for r in reports] == [want, want]


def test_versions_equal_gathered_weights_bit_for_bit(trained, tmp_path):
    from safetensors.torch import load_file

    from stitch_core.format import fingerprint as fpr
    from stitch_core.format.views import project
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.store import list_manifests

    work, _ = trained
    ms = {m.version: m for m in asyncio.run(list_manifests(LocalBoard(work / "board"), RUN))}
    for v in range(STEPS + 1):
        if v == 0:
            want = project(load_file(work / "ckpt" / "model.safetensors"), "bf16")
        else:
            want = _served(torch.load(work / f"full-{v}.pt"))
        got = _pull(work, v, tmp_path / f"v{v}")
        assert got.keys() == want.keys(), v
        bad = [k for k in want if not _same(got[k], want[k])]
        assert not bad, (v, bad)
        assert ms[v].fingerprints == fpr.state_fingerprints(want), v
    # the last version is the model at the end of training (accelerate's full state dict)
    final = _served(torch.load(work / "final.pt"))
    assert all(_same(got[k], final[k]) for k in final) and got.keys() == final.keys()
    first = _served(torch.load(work / "full-1.pt"))
    assert any(not _same(first[k], final[k]) for k in final)  # the weights really moved


def test_pulled_last_version_loads_in_transformers(trained, tmp_path):
    from transformers import LlamaForCausalLM

    work, _ = trained
    _pull(work, STEPS, tmp_path / "last")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "last", dtype=torch.bfloat16)
    final = _served(torch.load(work / "final.pt"))
    sd = loaded.state_dict()
    assert all(_same(sd[k], final[k]) for k in final)
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])


def test_plain_publisher_refused_on_every_rank(trained):
    work, reports = trained
    for r in reports:
        assert r["refused"] and "FSDPPublisher" in r["refused"], r["refused"]
    assert not (work / "board-plain" / "plain" / "latest").exists()


def test_fsdp1_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    from stitch_trainer.fsdp import FSDPPublisher
    from stitch_trainer.hf import StitchCallback

    # FSDP1 needs an accelerator device to wrap anything (on the CPU: "FSDP needs a non-CPU
    # accelerator device"): an unwrapped instance is enough for the layout check
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.add_module("wrapped", fsdp1)
    pub = FSDPPublisher.__new__(FSDPPublisher)  # no process group needed before a publish
    for cb in (StitchCallback(pub), StitchCallback(object())):
        with pytest.raises(RuntimeError, match="FSDP1"):
            cb.on_train_begin(None, None, None, model=model)


def test_start_from_needs_a_collective_publisher():
    from stitch_trainer.hf import StitchCallback

    with pytest.raises(ValueError, match="collective"):
        StitchCallback(object(), start_from="/models/x")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
