"""`stitch analyze`: how sparse are served-view patches, per step and per tensor group?

Two sources:

* **training** (``stitch analyze MODEL``): N real optimizer steps on fp32 masters (AdamW, or Muon
  for hidden 2-D matrices with AdamW for the rest). A Hugging Face directory trains on a causal-LM
  loss over a small corpus; a bare ``.safetensors`` file (no forward pass possible) trains on a
  synthetic loss, a fresh random projection of the weights each step (Gaussian gradients). After
  each step the masters are projected to the served view (fp8 scales pinned to the previous view),
  diffed against the previous view, and counted per group: changed elements, patch bytes, and the
  push-vs-floor prediction.
* **a board** (``stitch analyze --board B --run R``): the published versions' manifests, split by
  group from the patch headers when the patches are local (a local board, or the fetch cache).

The push-vs-floor rule is a heuristic: an element is predicted to change when its master update
is larger than half a ULP of its served value (in code units times the block scale for fp8).
It ignores where the master sits inside its rounding interval, so it misses the small updates that
happen to cross a nearby boundary; ``expected`` = mean(min(1, |update| / ULP)) is the fraction for
masters placed uniformly in their interval. The measured count is the truth: a served element
changes exactly when its master crossed a rounding boundary (or its fp8 scale moved).

One job per module; import each name from the module that owns it: `.groups` (tensor groups and
per-group counts), `.estimate` (the push-vs-floor prediction and ``expected``), `.experiment`
(training mode), `.board` (board mode), `.report` (text tables), `.plots` (the PNG) and `.cli`
(the verb; `add_parser` is the ``stitch.cli`` entry point ``stitch_trainer.analyze:add_parser``).
"""

from __future__ import annotations

from .cli import add_parser

__all__ = ["add_parser"]
