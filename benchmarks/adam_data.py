"""A realistic stream of fp32 master weights: a synthetic transformer trained by AdamW.

The model is a Llama-style decoder in Hugging Face layout (untied ``lm_head``, grouped-query
attention, SwiGLU MLP, RMSNorm weights). Matrices start ~N(0, 0.02), norms ~1 + N(0, 0.01).

Gradients are not those of a real loss but have the structure that matters for patch sizes:

* a per-tensor low-rank "signal" (rank 4 for matrices, a dense vector for norms) that drifts
  slowly from step to step (AR(1), rho = 0.9), so Adam's moments build up consistent directions;
* iid Gaussian noise on top (twice the signal's per-element std), as in small-batch RL;
* a per-tensor gradient scale (log-uniform over a decade around 1e-3), so Adam's epsilon is
  negligible as it is in practice;
* row-sparse embedding gradients: only the rows of tokens drawn (Zipf) in the step's batch.

Everything is seeded, so runs at different learning rates see the same gradient sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

HEAD_DIM = 64
SIGNAL_RANK = 4
SIGNAL_RHO = 0.9
NOISE_TO_SIGNAL = 2.0


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, in HF checkpoint order."""
        h, kv = self.hidden, self.kv_heads * HEAD_DIM
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "self_attn.q_proj.weight"] = (self.heads * HEAD_DIM, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, self.heads * HEAD_DIM)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.up_proj.weight"] = (self.intermediate, h)
            out[p + "mlp.down_proj.weight"] = (h, self.intermediate)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())


def shape_for(n_params: float) -> ModelShape:
    """The smallest model of a simple family (hidden ~ sqrt(n/80)) with at least n_params."""
    hidden = max(128, 64 * round(math.sqrt(n_params / 80) / 64))
    heads = hidden // HEAD_DIM
    base = ModelShape(
        hidden=hidden,
        intermediate=64 * math.ceil(2.75 * hidden / 64),
        layers=0,
        vocab=16 * hidden,
        heads=heads,
        kv_heads=max(1, heads // 4),
    )
    per_layer = ModelShape(**{**base.__dict__, "layers": 1}).n_params - base.n_params
    layers = max(1, math.ceil((n_params - base.n_params) / per_layer))
    return ModelShape(**{**base.__dict__, "layers": layers})


def init_masters(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, s in shape.shapes().items():
        if len(s) == 1:
            out[name] = 1.0 + 0.01 * torch.randn(s, generator=g)
        else:
            out[name] = 0.02 * torch.randn(s, generator=g)
    return out


class Gradients:
    """Seeded synthetic gradients with a drifting low-rank signal plus iid noise."""

    def __init__(self, masters: dict[str, torch.Tensor], vocab: int, seed: int):
        self._g = torch.Generator().manual_seed(seed + 1)
        self._vocab = vocab
        self._scale = {
            n: 1e-3 * 10 ** (torch.rand((), generator=self._g).item() - 0.5) for n in masters
        }
        self._factors: dict[str, list[torch.Tensor]] = {}
        for n, t in masters.items():
            dims = [t.shape[0]] if t.dim() == 1 else [t.shape[0], t.shape[1]]
            rank = 1 if t.dim() == 1 else SIGNAL_RANK
            self._factors[n] = [torch.randn(d, rank, generator=self._g) for d in dims]
        # Zipf(1.1) over token ids for the rows an embedding batch touches
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self._zipf = (1.0 / ranks**1.1) / (1.0 / ranks**1.1).sum()
        self._perm = torch.randperm(vocab, generator=self._g)

    def _signal(self, name: str) -> torch.Tensor:
        fs = self._factors[name]
        for i, f in enumerate(fs):
            noise = torch.randn(f.shape, generator=self._g)
            fs[i] = SIGNAL_RHO * f + math.sqrt(1 - SIGNAL_RHO**2) * noise
        if len(fs) == 1:
            return fs[0].reshape(-1).clone()
        return (fs[0] @ fs[1].T) / math.sqrt(SIGNAL_RANK)

    def _touched_rows(self, n_tokens: int) -> torch.Tensor:
        ids = torch.multinomial(self._zipf, n_tokens, replacement=True, generator=self._g)
        return self._perm[ids].unique()

    def step(self, masters: dict[str, torch.Tensor]) -> None:
        """Set .grad of every master."""
        rows = self._touched_rows(4 * self._vocab)
        for name, t in masters.items():
            g = self._signal(name)
            g += NOISE_TO_SIGNAL * torch.randn(g.shape, generator=self._g)
            g *= self._scale[name]
            if "embed_tokens" in name:
                mask = torch.zeros(t.shape[0], 1)
                mask[rows] = 1.0
                g *= mask
            t.grad = g.to(t.dtype)


def adamw_run(
    n_params: float, lr: float, steps: int, *, seed: int = 0, weight_decay: float = 0.01
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the fp32 masters at step 0 (init) and after each of `steps` AdamW steps.

    The same dict of tensors is yielded each time and updated in place: copy what you keep.
    """
    shape = shape_for(n_params)
    masters = init_masters(shape, seed)
    for t in masters.values():
        t.requires_grad_(True)
    opt = torch.optim.AdamW(masters.values(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    grads = Gradients(masters, shape.vocab, seed)
    plain = {n: t.detach() for n, t in masters.items()}
    yield plain
    for _ in range(steps):
        grads.step(masters)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield plain


if __name__ == "__main__":
    for target in (4e6, 20e6):
        s = shape_for(target)
        print(f"{target:.0e}: {s} -> {s.n_params / 1e6:.2f}M params")
