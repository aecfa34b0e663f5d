"""Routing replay (R3) through a following SGLang engine, across an apply.

A tiny Qwen3-MoE follower with SGLang's routed-experts capture on (`--enable-return-routed-experts`,
its host buffer allocated by the dev allocator: STITCH_DEV_HOST_ALLOC=plain, since this host has
no GPU driver for SGLang's cudaHostRegister) answers an unpinned greedy /generate with
`return_routed_experts` while a new version is applied (STITCH_KV_AFTER_APPLY=recompute, the
default: SGLang's retract, then a prefill on the new weights). Its `meta_info.routed_experts`
(rows of positions 0 .. seqlen - 2) and `stitch.version_spans` must agree: the rows each span
owns (`protocol.routing_spans`: position p belongs to output token max(0, p - prompt_len + 1))
are those a plain SGLang engine (no plugin) at that span's version returns for the same prefix,
bit for bit. The follower's rows before the boundary are the old version's although SGLang's
recompute forwarded those positions again on the new weights (`stitch_sglang.routed` keeps the
first forward's rows at the retract); the test checks that the new version routes some of them
differently, so the splice is what makes them right.

Two engine starts: the follower, then a plain engine on v0 that loads v1 through SGLang's own
loader (`/update_weights_from_disk`).
"""

from __future__ import annotations

import asyncio
import json
import types
import uuid

import numpy as np
import torch

from stitch_core.serve import protocol
from stitch_core.versions.board import LocalBoard
from stitch_core.versions.materialize import pull
from stitch_dev.engines import SglangServer
from stitch_sglang import routed

PROMPT = [11, 42, 7, 99, 23, 5]  # token ids
N = 120
ROUTED = ["--enable-return-routed-experts"]
P = len(PROMPT)


def _per_expert(tensors: dict) -> dict:
    """transformers 5 keeps a Qwen3-MoE layer's experts as two 3D tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); SGLang 0.5.23's
    Qwen3-MoE loader reads only the per-expert checkpoint names (and skips the fused ones without
    a word), so the run is published with those."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :half].contiguous()
                out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, half:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def _moe_run(root, nats_url: str, run: str):
    """A tiny Qwen3-MoE trained by stitch_dev's AdamWTrainer, published with per-expert names;
    v0 published and pulled into root/v0."""
    from stitch_dev.tinymodel import build_tiny_model
    from stitch_dev.trainer import AdamWTrainer
    from stitch_trainer.publisher import named_tensors

    model_dir = build_tiny_model(root / "model", arch="qwen3_moe", max_position_embeddings=2048)
    trainer = AdamWTrainer(model_dir, root / "board", nats_url, run)
    publish = trainer.pub.publish
    trainer.pub.publish = lambda step, model: publish(step, _per_expert(named_tensors(model)))
    assert trainer.publish() == 0
    asyncio.run(pull(LocalBoard(root / "board"), run, 0, root / "v0", root / "cache",
                     quiet=True))
    return trainer


def _generate(server, prompt: list[int], n: int, salt: bool = True) -> dict:
    body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if salt:  # no radix reuse between comparison requests
        body["cache_salt"] = uuid.uuid4().hex
    r = server.http.post("/generate", timeout=300, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(body: dict) -> list[int]:
    return [int(t) for _, t, *_ in body["meta_info"]["output_token_logprobs"]]


def _rows(body: dict, cfg: dict) -> np.ndarray:
    return protocol.decode_routed_experts(body["meta_info"]["routed_experts"],
                                          cfg["num_hidden_layers"], cfg["num_experts_per_tok"])


def test_routing_rows_follow_the_version_spans_across_an_apply(engine, tmp_path, nats_server):
    run = "sg-r3"
    trainer = _moe_run(tmp_path, nats_server.url, run)
    cfg = json.loads((tmp_path / "v0" / "config.json").read_text())
    server = SglangServer(tmp_path / "v0", tmp_path / "follower.log",
                          extra=["--enable-metrics", *ROUTED], dev_host_alloc="plain",
                          board=str(tmp_path / "board"), nats_url=nats_server.url, run=run,
                          cache_dir=str(tmp_path / "engine-cache"), reconcile_interval="1")
    try:
        engine.ready(server)
        v0 = server.status()["version"]
        r, v1 = server.across_an_apply(lambda: server.http.post("/generate", timeout=300, json={
            "input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}),
            trainer.publish)
        assert r.status_code == 200, r.text
        log = server.tail(400)
    finally:
        server.stop()
        trainer.pub.close()
    assert "dev host allocator" in log, log[-3000:]
    body = r.json()
    ids, rows = _ids(body), _rows(body, cfg)
    info = protocol.parse_stitch(body)
    assert info is not None and info.version_spans is not None, body.get("stitch")
    spans = [tuple(s) for s in info.version_spans]
    assert [v for v, _, _ in spans] == [v0, v1] and spans[-1][2] == N - 1 == len(ids) - 1, spans
    assert rows.shape == (P + N - 1, cfg["num_hidden_layers"], cfg["num_experts_per_tok"])
    owned = protocol.routing_spans(spans, P)
    assert [(v, lo) for v, lo, _ in owned] == [(v0, 0), (v1, P - 1 + spans[1][1])], owned
    assert owned[-1][2] == rows.shape[0] - 1  # every row owned by exactly one span
    per_row = protocol.routing_versions(spans, P, rows.shape[0])
    assert per_row == [v for v, lo, hi in owned for _ in range(lo, hi + 1)]
    a = spans[1][1]  # the first token of v1
    print(f"spans {spans}; routing rows {rows.shape}; v{v0} owns rows 0..{owned[0][2]}")

    # the reference: a plain engine (no plugin) started on v0, v1 loaded by SGLang's own loader
    # (SglangServer.load_weights: /update_weights_from_disk, cache flushed)
    dirs = {v: tmp_path / f"v{v}-fresh" for v in (v0, v1)}
    for v, d in dirs.items():
        asyncio.run(pull(LocalBoard(tmp_path / "board"), run, v, d, tmp_path / "cache",
                         quiet=True))
    fresh = {}
    eng = SglangServer(dirs[v0], tmp_path / "fresh.log", plain=True, extra=ROUTED,
                       dev_host_alloc="plain")
    try:
        eng.wait_healthy()
        for v, prompt, n in ((v0, PROMPT, a), (v1, PROMPT + ids[:a], N - a)):
            if v != v0:
                eng.load_weights(dirs[v])
            fresh[v] = _generate(eng, prompt, n)
    finally:
        eng.stop()
    assert _ids(fresh[v0]) == ids[:a] and _ids(fresh[v1]) == ids[a:], "greedy tokens differ"
    f0, f1 = _rows(fresh[v0], cfg), _rows(fresh[v1], cfg)
    assert f0.shape[0] == P + a - 1 and f1.shape[0] == P + N - 1
    for v, lo, hi in owned:
        want = (f0 if v == v0 else f1)[lo:hi + 1]
        have = rows[lo:hi + 1]
        bad = np.flatnonzero((want != have).any(axis=(1, 2)))
        assert bad.size == 0, (f"v{v} rows {lo}..{hi}: {bad.size} differ, first at row "
                               f"{lo + bad[0]}: follower {have[bad[0]].tolist()}, fresh "
                               f"{want[bad[0]].tolist()}")
    # the recompute forwarded the v0 rows again on v1: some route differently there, so the
    # answer has them from their first forward (stitch_sglang.routed), not from the recompute
    lo, hi = owned[0][1], owned[0][2]
    changed = int((f1[lo:hi + 1] != rows[lo:hi + 1]).any(axis=(1, 2)).sum())
    print(f"{changed} of {hi - lo + 1} v{v0} rows route differently under v{v1}")
    assert changed > 0, "v1 routes every v0 row the same: the test cannot tell the versions apart"


# ------------------------------------------------------------------ the hooks, without an engine


class _Pool:
    def __init__(self, slots: list[int]):
        self.req_to_token = torch.tensor([slots], dtype=torch.int32)


def _req(prompt: int, outputs: int, committed: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        rid="r", return_routed_experts=True, origin_input_ids=list(range(prompt)),
        output_ids=list(range(outputs)), routed_experts=None, routed_experts_start_len=0,
        kv=types.SimpleNamespace(holds_kv=True, req_pool_idx=0, kv_committed_len=committed))


def test_a_retract_keeps_the_first_forward_rows_and_the_answer_gets_them(monkeypatch):
    buf = torch.arange(40 * 2 * 3, dtype=torch.int32).reshape(40, 2, 3)
    capturer = types.SimpleNamespace(host_cache=types.SimpleNamespace(buffer=buf))
    monkeypatch.setattr(routed, "_capturer", lambda: capturer)
    slots = [30, 31, 32, 33, 34, 35, 36, 37]
    req = _req(prompt=3, outputs=3, committed=5)  # positions 0..4 forwarded, token 5 not yet

    def release(*, req, req_to_token_pool):  # SGLang's: KV freed, slots reused
        buf[30:38] = -1
        return "released"

    assert routed.keep_forwarded_rows(release, req=req, req_to_token_pool=_Pool(slots)) \
        == "released"
    kept = getattr(req, routed.ATTR)
    assert kept.shape == (5, 2, 3) and kept[0, 0, 0].item() == 30 * 6
    # a second retract later (another apply): the first rows stay, later ones are appended
    buf[30:38] = 7
    req.output_ids.append(9)
    req.kv.kv_committed_len = 6
    routed.keep_forwarded_rows(release, req=req, req_to_token_pool=_Pool(slots))
    kept = getattr(req, routed.ATTR)
    assert kept.shape == (6, 2, 3) and kept[0, 0, 0].item() == 180 and kept[5, 0, 0].item() == 7
    # the recomputed answer (positions 0..6) gets the kept rows over its first six
    req.routed_experts = torch.full((7, 2, 3), 5, dtype=torch.int32)
    routed.splice_kept_rows(None, object(), req)
    assert torch.equal(req.routed_experts[:6], kept) and (req.routed_experts[6] == 5).all()
    assert getattr(req, routed.ATTR) is None


def test_nothing_is_kept_before_the_first_token_or_without_the_option(monkeypatch):
    assert routed.forwarded_rows(prompt_len=4, outputs=0, committed=4) == 0
    assert routed.forwarded_rows(prompt_len=4, outputs=2, committed=9) == 5
    buf = torch.zeros(8, 1, 1, dtype=torch.int32)
    monkeypatch.setattr(routed, "_capturer",
                        lambda: types.SimpleNamespace(host_cache=types.SimpleNamespace(buffer=buf)))
    for req in (_req(3, 0, 3), types.SimpleNamespace(**{**vars(_req(3, 2, 4)),
                                                        "return_routed_experts": False})):
        routed.keep_forwarded_rows(lambda **kw: None, req=req, req_to_token_pool=_Pool([0] * 8))
        assert getattr(req, routed.ATTR, None) is None
    # a start offset: the answer's row 0 is position start_len
    req = _req(3, 2, 4)
    routed.keep_forwarded_rows(lambda **kw: None, req=req, req_to_token_pool=_Pool(list(range(8))))
    setattr(req, routed.ATTR, torch.arange(4, dtype=torch.int32).reshape(4, 1, 1))
    req.routed_experts_start_len = 2
    req.routed_experts = torch.full((2, 1, 1), 9, dtype=torch.int32)
    routed.splice_kept_rows(None, object(), req)
    assert req.routed_experts.flatten().tolist() == [2, 3]


def test_the_dev_host_allocator_is_installed_only_when_asked(monkeypatch):
    """STITCH_DEV_HOST_ALLOC=plain puts stitch_dev's allocator under SGLang's
    ALLOC_MEMORY_FUNCS["cpu"]; unset or a bad value leaves SGLang's cudaHostRegister one."""
    from stitch_dev import host_alloc
    from stitch_dev.procs import SGL_KERNEL_STUB
    from stitch_sglang import plugin

    monkeypatch.syspath_prepend(str(SGL_KERNEL_STUB))  # no CPU build of sgl_kernel
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.mem_cache.pool_host import common

    funcs = common.ALLOC_MEMORY_FUNCS
    monkeypatch.setitem(funcs, "cpu", funcs["cpu"])  # put back afterwards
    sglangs = funcs["cpu"]
    assert sglangs.__name__ == "alloc_with_host_register"
    assert plugin.install_dev_host_alloc({}) is None
    assert plugin.install_dev_host_alloc({"STITCH_DEV_HOST_ALLOC": "pinned"}) is None
    assert funcs["cpu"] is sglangs
    assert plugin.install_dev_host_alloc({"STITCH_DEV_HOST_ALLOC": "plain"}) == \
        "stitch_dev.host_alloc.plain_alloc"
    assert funcs["cpu"] is host_alloc.plain_alloc
    t = funcs["cpu"]((3, 2, 2), dtype=torch.int32, device="cpu", pin_memory=True,
                     allocator=object())
    assert t.shape == (3, 2, 2) and t.dtype == torch.int32
