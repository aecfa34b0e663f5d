"""Scheduler side of the SGLang plugin: one `RankReplica` per TP rank, reached by a custom
control request.

SGLang runs one scheduler process per TP rank. Control requests from the TokenizerManager (the
HTTP process) reach TP rank 0, which broadcasts them to every rank; each rank runs the handler
registered for the request's type between engine steps, and only rank 0's return value is sent
back. So the handler installed here (an AFTER hook on `Scheduler.init_request_dispatcher`, see
`stitch_sglang.plugin`) runs `RankReplica.handle(request)` on its rank's model, then
every rank joins one `all_gather_object` on the TP CPU (gloo) group, as SGLang's own
`check_weights` does, and rank 0 returns all replies in rank order. Every rank reaches the
collective even when its call failed: errors travel as strings and the HTTP side raises them.

Typed requests and replies (`stitch_core.engine.rpc`, encoded as bytes) travel inside two msgspec
request types registered with
`io_struct.hook_custom_types` in every SGLang process (their msgspec tag is the class name).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from sglang.srt.managers.io_struct import BaseReq

log = logging.getLogger("stitch.sglang")
REFUSED = ("this engine follows a Stitch run: its weights change only through Stitch patches that "
           "every rank proves, so SGLang's online weight updates (update_weights_from_disk, "
           "_tensor, _distributed, _ipc) are refused; publish a version to the run instead")

__all__ = ["REFUSED", "StitchCallReqInput", "StitchCallReqOutput", "install_handler",
           "rank_info", "refuse_weight_session"]


class StitchCallReqInput(BaseReq, kw_only=True):
    """One `RankReplica` request for every TP rank: its type name (for logs), its encoding and
    the caller's id for it (echoed in the reply: a late reply is never taken for another's)."""

    method: str
    blob: bytes
    call_id: str = ""


class StitchCallReqOutput(BaseReq, kw_only=True):
    """Encoded replies in TP rank order; `error` joins the ranks' errors (None: all succeeded)."""

    replies: list[bytes]
    error: str | None = None
    call_id: str = ""


def rank_info() -> dict[str, Any]:
    """This rank's tp/pp rank and size and dp rank, as far as SGLang publishes them."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    info: dict[str, Any] = {}
    for key in ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank"):
        with contextlib.suppress(Exception):  # not published in this configuration
            info[key] = getattr(p, key)
    return info


def _sglang_version() -> str | None:
    try:
        import sglang

        return getattr(sglang, "__version__", None)
    except Exception:  # pragma: no cover - SGLang is the host process
        return None


def _replica(scheduler: Any):
    rep = getattr(scheduler, "_stitch_rep", None)
    if rep is None:
        from stitch_core.engine.layout_cache import code_identity, from_settings
        from stitch_core.engine.replica import RankReplica
        from stitch_core.settings import Settings

        model = scheduler.tp_worker.model_runner.model
        info = rank_info()
        args = getattr(scheduler, "server_args", None)
        identity = {"engine": "sglang", "version": _sglang_version(), **code_identity(model),
                    "dtype": str(getattr(args, "dtype", None)),
                    "quantization": getattr(args, "quantization", None), "rank": info}
        from .cpu import kernel_names, rebuild_dirty

        fp8 = kernel_names(model)
        if fp8:  # which kernels serve the quantized layers (shown in /stitch/status)
            info = {**info, "kernels": {"fp8": ", ".join(fp8)}}
        rep = RankReplica(model, rank_info=info, layout_cache=from_settings(identity),
                          on_dirty=lambda dirty: rebuild_dirty(model, dirty),
                          layout_templates=Settings.read("layout_templates"),
                          prebuild_memory=Settings.read("prebuild_memory"))
        # SGLang refuses its online weight updates on a model that declares a reason (checked on
        # every rank before any write): on a follower, weights change only through proven patches
        model._derived_weight_cache_error = REFUSED
        scheduler._stitch_rep = rep
    return rep


def _call(scheduler: Any, method: str, blob: bytes) -> bytes:
    rep = _replica(scheduler)
    if torch.cuda.is_available() and any(p.is_cuda for p in rep.model.parameters()):
        # the overlap scheduler may still have a forward in flight on the device
        torch.cuda.synchronize()
    from stitch_core.engine import rpc

    req = rpc.decode(blob)
    if type(req).__name__ != method:
        raise TypeError(f"request {type(req).__name__} sent as {method}")
    return rpc.encode(rep.handle(req))


def handle(scheduler: Any, req: StitchCallReqInput) -> StitchCallReqOutput:
    """Run on every TP rank (same order on all of them); rank 0's return value is the reply."""
    try:
        reply, err = _call(scheduler, req.method, req.blob), None
    except Exception as e:
        group = scheduler.tp_group
        log.exception("stitch: %s failed on TP rank %s", req.method, group.rank_in_group)
        reply, err = b"", f"TP rank {group.rank_in_group}: {type(e).__name__}: {e}"
    group = scheduler.tp_group
    if group.world_size > 1:
        gathered: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(gathered, (reply, err), group=group.cpu_group)
    else:
        gathered = [(reply, err)]
    errors = [e for _, e in gathered if e]
    return StitchCallReqOutput(replies=[r for r, _ in gathered],
                               error="; ".join(errors) if errors else None, call_id=req.call_id)


def install_handler(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on `Scheduler.init_request_dispatcher`: route StitchCallReqInput to `handle`."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(StitchCallReqInput, lambda req: handle(scheduler, req))])
    return result


def refuse_weight_session(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on `SchedulerWeightUpdaterManager.begin_weight_update`: on a follower (its
    model carries `REFUSED`, set on every rank when the follower starts) no weight-update session
    opens, so SGLang's session-bound updates (from tensors, a process group, IPC) never run, nor
    its ``end_weight_update`` post-load pass over layers already processed. Its
    ``update_weights_from_disk`` needs no session: SGLang itself refuses it on the same attribute
    (`_derived_weight_cache_error`). Elsewhere SGLang's own step runs."""
    model = getattr(getattr(getattr(manager, "tp_worker", None), "model_runner", None), "model",
                    None)
    if getattr(model, "_derived_weight_cache_error", None) == REFUSED:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqOutput

        log.warning("stitch: refused SGLang's begin_weight_update: this engine follows a run")
        return BeginWeightUpdateReqOutput(success=False, message=REFUSED)
    return original(manager, *args, **kwargs)
