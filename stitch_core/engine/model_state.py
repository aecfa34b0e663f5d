"""What a model holds besides its parameters, kept while layout learning runs its loaders.

Size: about 80 lines, one job: `TensorState`. Layout learning (`stitch_core.engine.layout`)
loads index tensors through the model's own loaders; a loader that also derives state from what
it loads (a post-load step inside `load_weights`) would leave that state computed from integer
indices. `TensorState` keeps every buffer and plain tensor attribute before the load and, after
it, names and puts back what changed, so that learning refuses such a model by name and the
engine keeps its own state. Runtime state an engine adapter knows no loader writes (vLLM's
per-layer ``kv_cache``: as large as the memory given to it) is left out (`not_state`); other CPU
state over `COPY_LIMIT` bytes is kept as a digest instead of a copy."""

from __future__ import annotations

from collections.abc import Collection

import torch

from stitch_core.engine.derived import digest

__all__ = ["COPY_LIMIT", "NOT_RESTORED", "TensorState"]

def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.detach().to("cpu").contiguous().reshape(-1)
    b = b.contiguous().reshape(-1)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8), b.view(torch.uint8))


# CPU state larger than this is kept as a digest (XXH3-128 of its bytes), not a copy: an
# engine's KV cache or packed weights can be as large as the model
COPY_LIMIT = 64 << 20
NOT_RESTORED = " (written in place, not restored)"


class TensorState:
    """Every buffer and plain tensor attribute of a model, kept so that what a loader changes
    while it loads index tensors can be named and put back: a CPU copy, or, for CPU tensors over
    `COPY_LIMIT` bytes, a digest (such a tensor written in place is named, not put back).
    Attributes named in `not_state` (runtime state an engine adapter knows no loader writes,
    e.g. vLLM's per-layer ``kv_cache``) are not kept at all."""

    def __init__(self, model: torch.nn.Module, not_state: Collection[str] = ()):
        self.kept: dict[str, tuple[torch.nn.Module, str, bool, torch.Tensor, int,
                                   torch.Tensor | bytes]] = {}
        for mod_name, mod in model.named_modules():
            items = [(k, v, True) for k, v in mod._buffers.items()]
            items += [(k, v, False) for k, v in vars(mod).items()
                      if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
            for attr, t, buffer in items:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and \
                        attr not in not_state:
                    key = f"{mod_name}.{attr}" if mod_name else attr
                    big = t.device.type == "cpu" and t.numel() * t.element_size() > COPY_LIMIT
                    kept = digest([t]) if big else t.detach().to("cpu", copy=True)
                    self.kept[key] = (mod, attr, buffer, t, t._version, kept)

    def restore(self) -> list[str]:
        """Put back what changed (rebound or written in place); return their names (a kept
        digest's tensor written in place: named with `NOT_RESTORED`)."""
        changed = []
        for key, (mod, attr, buffer, t, version, kept) in self.kept.items():
            now = mod._buffers.get(attr) if buffer else vars(mod).get(attr)
            # a bumped version counter with the same bits: a view of a parameter the loader
            # wrote through (the writes went to the shadow), not a change
            same = t._version == version or _same_as_kept(t, kept)
            if now is t and same:
                continue
            if buffer:
                mod._buffers[attr] = t
            else:
                setattr(mod, attr, t)
            if same:
                changed.append(key)  # rebound only: put back
            elif isinstance(kept, bytes):
                changed.append(key + NOT_RESTORED)
            else:
                changed.append(key)
                with torch.no_grad():
                    t.copy_(kept)
        return sorted(changed)


def _same_as_kept(t: torch.Tensor, kept: torch.Tensor | bytes) -> bool:
    return digest([t]) == kept if isinstance(kept, bytes) else _same_bits(t, kept)
