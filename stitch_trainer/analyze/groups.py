"""Tensor groups of HF names, and the per-group counts and fractions of an analyze report."""

from __future__ import annotations

GROUPS = (
    "embed", "attn_q", "attn_k", "attn_v", "attn_o",
    "mlp_gate", "mlp_up", "mlp_down", "norm", "lm_head", "other",
)  # fmt: skip
_PATTERNS = (
    ("embed", ("embed", "wte", "wpe")),
    ("lm_head", ("lm_head",)),
    ("attn_q", ("q_proj",)),
    ("attn_k", ("k_proj",)),
    ("attn_v", ("v_proj",)),
    ("attn_o", ("o_proj", "out_proj")),
    ("mlp_gate", ("gate_proj",)),
    ("mlp_up", ("up_proj",)),
    ("mlp_down", ("down_proj",)),
    ("norm", ("norm", "ln_")),
)
FIELDS = ("total_elements", "changed_elements", "payload_bytes", "predicted", "expected")


def group_of(name: str) -> str:
    """Tensor group of an HF tensor name (fp8 scales fall into their weight's group)."""
    for group, keys in _PATTERNS:
        if any(k in name for k in keys):
            return group
    return "other"


def empty_counts() -> dict[str, float]:
    """Zero counts of every field."""
    return dict.fromkeys(FIELDS, 0)


def fractions(c: dict[str, float]) -> dict[str, float]:
    """Counts as a report row: integers (``expected`` rounded) plus the fractions of the total."""
    n = max(c["total_elements"], 1)
    out = {k: (int(v) if k != "expected" else round(v, 3)) for k, v in c.items()}
    out["changed_fraction"] = c["changed_elements"] / n
    if "predicted" in c:
        out["predicted_fraction"] = c["predicted"] / n
        out["expected_fraction"] = c["expected"] / n
    return out


def group_fractions(groups: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """`fractions` of each group's counts, in `GROUPS` order."""
    return {g: fractions(groups[g]) for g in GROUPS if g in groups}


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per group (and `total`), fractions over all measured steps together."""
    acc: dict[str, dict[str, float]] = {}
    for r in rows:
        for g, c in (r.get("groups") or {}).items():
            for name in (g, "total"):
                a = acc.setdefault(name, {k: 0 for k in FIELDS if k in c})
                for k in a:
                    a[k] += c[k]
    n = sum(1 for r in rows if r.get("groups") is not None)
    out = {}
    for g, a in acc.items():
        f = fractions(a)
        f["payload_bytes_per_step"] = a["payload_bytes"] / max(n, 1)
        f["total_elements"] = a["total_elements"] // max(n, 1)
        out[g] = f
    return out
