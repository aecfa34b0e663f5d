"""Worker side of the vLLM plugin.

Used as `--worker-extension-cls stitch_vllm.worker.StitchWorkerExtension`.

vLLM mixes this class into its worker on every TP rank; `collective_rpc("stitch_call",
args=(blob,))` reaches all of them with one encoded typed request (`stitch_core.engine.rpc`). Each
rank holds a `stitch_core.engine.replica.RankReplica` over its shard of the model (layout learned
from the model's own loaders, gather/write/undo/commit, full sums); the coordinator in the API
server process (`stitch_vllm.server`) decodes patches and drives the ranks.

Requests and replies cross as bytes: vLLM's msgpack channel turns arrays into memoryviews that
the worker message queue cannot carry. The channel is the engine's own, between its own
processes.

Imports stay light (torch, numpy); the replica and the codec are imported on the first call.
numba is safe here (see stitch_core/_jit.py for the vLLM start-up scan it used to trip).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from stitch_core.engine.layout import engine_params, read_safetensors_shapes
from stitch_core.engine.layout_cache import code_identity, from_settings
from stitch_core.settings import Settings

from .cpu import repack_dirty
from .fp8 import kernel_names
from .fp8_online import requantized_blocks

__all__ = ["StitchWorkerExtension"]
log = logging.getLogger("stitch.vllm")


class StitchWorkerExtension:
    """Mixed into vLLM's worker class; every name starts with ``stitch_`` (no clash)."""

    def _stitch_model(self):
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def stitch_rank_info(self) -> dict[str, Any]:
        from vllm.distributed import parallel_state as ps

        info: dict[str, Any] = {"rank": getattr(self, "rank", None)}
        try:
            info["tp_rank"] = ps.get_tensor_model_parallel_rank()
            info["tp_size"] = ps.get_tensor_model_parallel_world_size()
            info["pp_rank"] = ps.get_pp_group().rank_in_group
        except Exception:  # pragma: no cover - not initialised
            pass
        try:  # which kernels serve the quantized layers (shown in /stitch/status)
            fp8 = kernel_names(self._stitch_model())
        except Exception:  # pragma: no cover - no model yet
            fp8 = {}
        if fp8:
            info["kernels"] = {"fp8": ", ".join(fp8)}
        return info

    def _stitch_replica(self):
        rep = getattr(self, "_stitch_rep", None)
        if rep is None:
            from stitch_core.engine.replica import RankReplica

            model = self._stitch_model()
            def on_dirty(dirty: set[str]) -> list[str]:
                t0 = time.perf_counter()
                self._stitch_repacked = repack_dirty(model, dirty)
                layers, blocks = requantized_blocks(model, self._stitch_repacked)
                if layers:
                    log.info("stitch: re-quantized %d online-FP8 layers (%d blocks) in %.1f ms",
                             layers, blocks, (time.perf_counter() - t0) * 1e3)
                return self._stitch_repacked

            info = self.stitch_rank_info()
            # vLLM binds each attention layer's KV cache to it as `kv_cache`: as large as the
            # memory given to it, and no loader writes it (not copied while the layout is learned)
            rep = RankReplica(model, on_dirty=on_dirty, rank_info=info,
                              layout_cache=from_settings(self._stitch_identity(model, info)),
                              not_state=("kv_cache",),
                              layout_templates=Settings.read("layout_templates"),
                              prebuild_memory=Settings.read("prebuild_memory"))
            self._stitch_rep = rep
        return rep

    def _stitch_identity(self, model, info: dict[str, Any]) -> dict[str, Any]:
        """What the learned layout depends on besides shapes (the layout cache's key)."""
        import vllm

        mc = self.vllm_config.model_config  # type: ignore[attr-defined]
        return {"engine": "vllm", "version": vllm.__version__, **code_identity(model),
                "dtype": str(mc.dtype), "quantization": mc.quantization, "rank": info}

    def stitch_call(self, blob: bytes) -> bytes:
        """One typed rank request (`stitch_core.engine.rpc`), encoded, in; its reply out. Never
        raises: a failure comes back as `rpc.Failed`. vLLM's executor reads the workers' replies
        rank by rank and raises at the first failed one, leaving the later ranks' replies queued,
        where the next call would read them as its own (every later reply one call late)."""
        import logging

        from stitch_core.engine import rpc

        try:
            return rpc.encode(self._stitch_replica().handle(rpc.decode(blob)))
        except Exception as e:
            logging.getLogger("stitch.vllm").exception("stitch: rank request failed")
            info = getattr(getattr(self, "_stitch_rep", None), "rank_info", {})
            return rpc.encode(rpc.Failed(f"{type(e).__name__}: {e}", dict(info)))

    # ------------------------------------------------------------ lower-level (tests, debugging)

    def stitch_learn_layout(self, hf_shapes=None) -> dict[str, Any]:
        """Learn this rank's layout map (as the coordinator's Setup does); its summary."""
        if hf_shapes is None:
            hf_shapes = read_safetensors_shapes(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        from stitch_core.format import dtypes

        rep = self._stitch_replica()
        rep.setup({n: (tuple(shape), dtypes.info(dt).name) for n, (shape, dt) in hf_shapes.items()})
        return rep.layout.summary()

    def stitch_apply(self, chunks) -> dict[str, Any]:
        """chunks: [(hf_name, positions, new values)] through the replica's one write path (read
        back, re-pack, derived-copy check), behind the coordinator's back (no manifest: a
        tampered rank, as tests make one); what was written and which modules re-packed. Also
        as a JSON string (vLLM's dev route ``POST /collective_rpc`` passes only strings), values
        as numbers cast to each tensor's served dtype."""
        if isinstance(chunks, str):
            import json

            tensors = self._stitch_replica()._layout().tensors
            chunks = [(n, pos, torch.tensor(vals, dtype=torch.float64).to(tensors[n].hf_dtype))
                      for n, pos, vals in json.loads(chunks)]
        self._stitch_repacked = []
        out = self._stitch_replica().put({n: (pos, vals) for n, pos, vals in chunks})
        out["repacked"] = self._stitch_repacked
        return out

    def stitch_param_bytes(self, names=None) -> dict[str, bytes]:
        """Raw bytes of engine params (kept masters for packed CPU layers)."""
        params = engine_params(self._stitch_model())
        return {n: p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                for n, p in params.items() if names is None or n in names}

    def stitch_derived_report(self) -> dict[str, Any]:
        """Kernels' private copies of weights on this rank: {kind: count}, stale ones, and
        closures no adapter accounts for (what tests print as the CPU path they exercised)."""
        from stitch_core.engine import derived

        model = self._stitch_model()
        return {"kinds": derived.kinds(model), "stale": derived.stale(model),
                "unmanaged": derived.unmanaged(model)}

    def stitch_param_shapes(self) -> dict[str, Any]:
        """Shapes of ``named_parameters`` as vLLM exposes them (packed layers may be empty)."""
        return {n: (tuple(p.shape), str(p.dtype))
                for n, p in self._stitch_model().named_parameters()}
