"""A tiny HF-style model and an engine-style tensor-parallel copy of it, for engine-agnostic tests.

`ToyEngine(rank, world)` stores weights the way inference engines do: q/k/v fused into
`qkv_proj` (column-parallel, per-rank slices of each), gate/up fused, `o_proj`/`down_proj`
row-parallel (a slice of every row), vocab rows padded and split over ranks, norms replicated and
kept in fp32 (a widened dtype), and one tensor (`model.layers.1.scale`) whose loader transforms the
values (x 0.5), which no layout map can place. Its `load_weights` takes HF names and tensors, like
vLLM's and SGLang's models.
"""

from __future__ import annotations

import torch
from torch import nn

V, D, F, KV = 50, 16, 32, 8  # vocab, hidden, mlp, k/v width


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(D, D)
        self.self_attn.k_proj = nn.Linear(D, KV)
        self.self_attn.v_proj = nn.Linear(D, KV)
        self.self_attn.o_proj = nn.Linear(D, D, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(D, F, bias=False)
        self.mlp.up_proj = nn.Linear(D, F, bias=False)
        self.mlp.down_proj = nn.Linear(F, D, bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(D))


class HFToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, D)
        self.model.layers = nn.ModuleList([_Layer()])
        self.model.layers.append(nn.Module())
        self.model.layers[1].scale = nn.Parameter(torch.ones(D))
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(D))
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x)
        lay = self.model.layers[0]
        a = lay.self_attn
        n = h * lay.input_layernorm.weight
        q, k, v = a.q_proj(n), a.k_proj(n), a.v_proj(n)
        att = torch.softmax(q[..., :KV] @ k.transpose(-1, -2) / KV ** 0.5, -1) @ v
        h = h + a.o_proj(torch.cat([att, q[..., KV:]], -1))
        m = lay.mlp
        h = h + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))
        h = h * self.model.layers[1].scale * self.model.norm.weight
        return self.lm_head(h)


def train(model: HFToy, steps: int, lr: float = 1e-3, seed: int = 0):
    """Yield the model after each AdamW step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randint(0, V, (4, 10), generator=g)
        loss = nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield model


class ToyEngine(nn.Module):
    def __init__(self, rank: int = 0, world: int = 1, dtype=torch.bfloat16):
        super().__init__()
        self.rank, self.world = rank, world
        self.vpad = -(-V // (8 * world)) * 8 * world
        vr = self.vpad // world
        p = lambda *s, dt=dtype: nn.Parameter(torch.zeros(*s, dtype=dt), requires_grad=False)  # noqa: E731
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = p(vr, D)
        lay = nn.Module()
        lay.qkv_proj = nn.Module()
        lay.qkv_proj.weight = p((D + 2 * KV) // world, D)
        lay.qkv_proj.bias = p((D + 2 * KV) // world)
        lay.o_proj = nn.Module()
        lay.o_proj.weight = p(D, D // world)
        lay.gate_up_proj = nn.Module()
        lay.gate_up_proj.weight = p(2 * F // world, D)
        lay.down_proj = nn.Module()
        lay.down_proj.weight = p(D, F // world)
        lay.input_layernorm = nn.Module()
        lay.input_layernorm.weight = p(D, dt=torch.float32)
        lay1 = nn.Module()
        lay1.scale = p(D, dt=torch.float32)
        self.model.layers = nn.ModuleList([lay, lay1])
        self.model.norm = nn.Module()
        self.model.norm.weight = p(D, dt=torch.float32)
        self.lm_head = nn.Module()
        self.lm_head.weight = p(vr, D)

    def _rows(self, t: torch.Tensor, n: int) -> torch.Tensor:
        k = n // self.world
        return t[self.rank * k:(self.rank + 1) * k]

    def load_weights(self, weights):
        L0 = self.model.layers[0]
        q, kv = D // self.world, KV // self.world
        loaded = set()
        for name, t in weights:
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                dst = (self.model.embed_tokens.weight if "embed" in name else self.lm_head.weight)
                vr = self.vpad // self.world
                lo = self.rank * vr
                rows = t[lo:min(lo + vr, V)]
                dst.data[: rows.shape[0]].copy_(rows)
                dst.data[rows.shape[0]:].zero_()  # vocab padding: a constant
            elif ".self_attn." in name and "o_proj" not in name:
                which = name.split(".self_attn.")[1].split(".")[0]
                off = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[which]
                n = {"q_proj": D, "k_proj": KV, "v_proj": KV}[which]
                dst = L0.qkv_proj.weight if name.endswith("weight") else L0.qkv_proj.bias
                shard = self._rows(t, n)
                dst.data[off:off + shard.shape[0]].copy_(shard)
            elif "o_proj" in name:
                L0.o_proj.weight.data.copy_(t[:, self.rank * q:(self.rank + 1) * q])
            elif "gate_proj" in name or "up_proj" in name:
                f = F // self.world
                off = 0 if "gate_proj" in name else f
                L0.gate_up_proj.weight.data[off:off + f].copy_(self._rows(t, F))
            elif "down_proj" in name:
                f = F // self.world
                L0.down_proj.weight.data.copy_(t[:, self.rank * f:(self.rank + 1) * f])
            elif "input_layernorm" in name:
                L0.input_layernorm.weight.data.copy_(t)
            elif name.endswith("layers.1.scale"):
                s = self.model.layers[1].scale
                s.data.copy_(t.float() * 0.5 if t.is_floating_point() else t // 2)
            elif name == "model.norm.weight":
                self.model.norm.weight.data.copy_(t)
            else:
                raise KeyError(name)
            loaded.add(name)
        return loaded


def served_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 served view of a model's state (what the engines hold)."""
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def publish_toy_run(board_dir, run: str, n: int) -> list[dict[str, torch.Tensor]]:
    """Train an HFToy for n - 1 steps, publishing v0..v(n-1) to a local board; their views."""
    from stitch_trainer.publisher import Publisher

    torch.manual_seed(0)
    model = HFToy()
    views = []
    with Publisher(str(board_dir), run, "bf16") as pub:
        pub.publish(0, model).result()
        views.append(served_view(model))
        for step, m in enumerate(train(model, n - 1), start=1):
            pub.publish(step, m).result()
            views.append(served_view(m))
        pub.flush()
    return views
