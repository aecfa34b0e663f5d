"""The PNG of an analyze report: changed fraction per step (or version) by tensor group."""

from __future__ import annotations

from pathlib import Path

from .groups import GROUPS


def plot(report: dict, path: str | Path) -> None:
    """PNG of the changed fraction (%) per step (versions on a board) by tensor group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xkey = "step" if report["mode"] == "train" else "version"
    rows = [r for r in report["steps"] if r.get("changed_fraction") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g in GROUPS:
        pts = [
            (r[xkey], 100 * r["groups"][g]["changed_fraction"])
            for r in rows
            if r.get("groups") and g in r["groups"]
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=g)
    ax.plot(
        [r[xkey] for r in rows],
        [100 * r["changed_fraction"] for r in rows],
        "k-",
        linewidth=2.5,
        label="total",
    )
    if report["mode"] == "train":
        ax.plot(
            [r[xkey] for r in rows],
            [100 * r["predicted_fraction"] for r in rows],
            "k--",
            label="total predicted",
        )
        title = (
            f"{report['optimizer']} lr={report['lr']:g}, view {report['view']}, "
            f"{report['loss']} loss"
        )
    else:
        title = f"board run {report['run']}"
    ax.set(xlabel=xkey, ylabel="served elements changed (%)", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
