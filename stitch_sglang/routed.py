"""Routing replay (R3) on SGLang: each routing row returned is the one of the forward that
first computed its position.

SGLang (``--enable-return-routed-experts``, ``return_routed_experts: true`` per request) records
the experts of every forwarded position in a host buffer indexed by KV slot
(``RoutedExpertsCapturer``: ``host_cache.buffer[out_cache_loc] = topk`` after each forward) and,
when a request finishes, reads its rows back through its KV slots
(``SchedulerBatchResultProcessor._maybe_collect_routed_experts`` -> ``get_topk``: positions
``[routed_experts_start_len, seqlen - 1)``, shape ``(rows, layers, top_k)``), which the
detokenizer sends base64-encoded as ``meta_info.routed_experts``.

A retract (``release_req``: SGLang's preemption, and the Stitch apply's pause under
STITCH_KV_AFTER_APPLY=recompute) frees the request's KV; the request is prefilled again, prompt
and tokens so far, and that forward overwrites the rows of every position before the retract:
under recompute, with the new version's weights. Two scheduler hooks keep the first rows:

* ``keep_forwarded_rows`` (AROUND ``schedule_batch.release_req``): before the KV is freed, the
  rows of the positions the request has already forwarded, ``[0, min(kv_committed_len,
  seqlen - 1))``, are copied from the host buffer onto the request (appended to those an
  earlier retract kept: the first forward wins). A request that has sampled no token yet keeps
  nothing: its prefill is redone whole, by one version, which also samples its first token.
* ``splice_kept_rows`` (AFTER ``_maybe_collect_routed_experts``): the kept rows replace the
  recomputed ones in the request's answer (a copy; the host buffer is not written).

So the alignment rule holds across applies in both modes: row ``p`` of the payload (position
``p``) belongs to output token ``j = max(0, p - prompt_len + 1)``, the token whose sampling
forward computed position ``p`` first, and its experts are those of the version whose span holds
``j`` (`stitch_core.serve.protocol.routing_versions`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("stitch.sglang")

__all__ = ["ATTR", "RELEASE_HOOK", "COLLECT_HOOK", "routed_hooks", "keep_forwarded_rows",
           "splice_kept_rows", "forwarded_rows"]

ATTR = "_stitch_routed_kept"  # on SGLang's Req: the kept rows, positions [0, len)
RELEASE_HOOK = "sglang.srt.managers.schedule_batch.release_req"
COLLECT_HOOK = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                "SchedulerBatchResultProcessor._maybe_collect_routed_experts")


def routed_hooks() -> list[tuple[str, Any, str]]:
    """(target, hook, HookType name) for `stitch_sglang.plugin.register`."""
    return [(RELEASE_HOOK, keep_forwarded_rows, "AROUND"),
            (COLLECT_HOOK, splice_kept_rows, "AFTER")]


def _capturer() -> Any:
    try:
        from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

        return get_global_experts_capturer()
    except Exception:  # no runtime context (not a scheduler) or another SGLang
        return None


def forwarded_rows(prompt_len: int, outputs: int, committed: int) -> int:
    """How many leading positions' rows a retracted request keeps: those it has forwarded
    (`committed`, SGLang's ``kv_committed_len``), at most ``seqlen - 1`` (the last sampled token
    is not forwarded yet); none before its first sampled token (its prefill is redone whole)."""
    if outputs <= 0:
        return 0
    return max(0, min(committed, prompt_len + outputs - 1))


def _keep(req: Any, pool: Any) -> int:
    """Copy the request's forwarded rows not kept yet; the number of rows kept after it."""
    kept = getattr(req, ATTR, None)
    k = 0 if kept is None else int(kept.shape[0])
    if not getattr(req, "return_routed_experts", False) or not req.kv.holds_kv:
        return k
    capturer = _capturer()
    if capturer is None or pool is None:
        return k
    n = forwarded_rows(len(req.origin_input_ids), len(req.output_ids),
                       int(req.kv.kv_committed_len))
    if n <= k:
        return k
    slots = pool.req_to_token[req.kv.req_pool_idx][k:n].to("cpu", torch.int64)
    rows = capturer.host_cache.buffer[slots].clone()
    setattr(req, ATTR, rows if kept is None else torch.cat([kept, rows]))
    log.info("stitch: request %s retracted: routing rows of positions [%d, %d) kept from their "
             "first forward", getattr(req, "rid", "?"), k, n)
    return n


def keep_forwarded_rows(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `release_req(*, req, req_to_token_pool, ...)`: keep the forwarded rows first."""
    req = kwargs.get("req")
    outputs = len(req.output_ids) if req is not None else 0
    try:
        if req is not None:
            _keep(req, kwargs.get("req_to_token_pool"))
    except Exception:  # never break SGLang's retract; the answer then has the recomputed rows
        log.exception("stitch: routing rows of a retracted request not kept")
    out = original(*args, **kwargs)
    if req is not None and getattr(req, ATTR, None) is not None and len(req.output_ids) < outputs:
        # SGLang dropped the tokens (input_embeds requests restart): the kept rows are void
        setattr(req, ATTR, None)
    return out


def splice_kept_rows(result: Any, processor: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `_maybe_collect_routed_experts(req)`: the kept rows over the recomputed ones."""
    kept = getattr(req, ATTR, None)
    got = getattr(req, "routed_experts", None)
    if kept is None or got is None:
        return result
    try:
        start = int(getattr(req, "routed_experts_start_len", 0) or 0)
        end = min(int(kept.shape[0]), start + int(got.shape[0]))
        if end > start and tuple(kept.shape[1:]) == tuple(got.shape[1:]):
            got[:end - start] = kept[start:end].to(got.dtype)
        setattr(req, ATTR, None)
    except Exception:
        log.exception("stitch: kept routing rows not spliced into request %s",
                      getattr(req, "rid", "?"))
    return result
