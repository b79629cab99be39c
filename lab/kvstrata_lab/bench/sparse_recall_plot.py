"""The plots of `kvstrata sparse-recall`: recall and mass against length per layer (selections that
missed the needle marked), and one long prompt's true attention over positions with the selection
and the needle's tokens marked."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    return plt


def plot_recall(records: list[dict], summary: list[dict], cfg, path: Path) -> None:
    """Mean recall@k (min dotted) and mean mass per layer against length; a red x per (prompt,
    query, head) whose selection missed the needle, at its recall."""
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    layers = sorted({r["layer"] for r in summary})
    for i, layer in enumerate(layers):
        rows = [r for r in summary if r["layer"] == layer]
        x = [r["length"] for r in rows]
        colour = f"C{i % 10}"
        label = f"layer {layer} ({rows[0]['mode']})"
        ax.plot(x, [r["recall_mean"] for r in rows], "o-", color=colour, label=label)
        ax.plot(x, [r["recall_min"] for r in rows], ":", color=colour)
        bx.plot(x, [r["mass_mean"] for r in rows], "o-", color=colour, label=f"layer {layer}")
        bx.plot(x, [r["mass_min"] for r in rows], ":", color=colour)
    missed = [r for r in records if not r["needle_selected"]]
    if missed:
        ax.scatter([r["length"] for r in missed], [r["recall"] for r in missed], marker="x", color="red",
                   zorder=5, label="needle not in selection")
        bx.scatter([r["length"] for r in missed], [r["mass"] for r in missed], marker="x", color="red",
                   zorder=5)
    lengths = sorted({r["length"] for r in summary})
    for a, name in ((ax, "recall@k of the indexer's top-k"), (bx, "true attention mass selected")):
        a.set_xscale("log", base=2)
        a.set_xticks(lengths, [f"{n / 1024:g}k" if n >= 1024 else str(n) for n in lengths])
        a.minorticks_off()
        a.set_xlabel("context tokens")
        a.set_ylabel(name)
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"{cfg.model}: {cfg.method} (dotted: min over prompts × queries × heads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_positions(length: int, prompt, trace: dict, cfg, path: Path) -> None:
    """Per full-attention layer, the last query's true attention (KV head 0) over positions, the
    positions the selection read, and the needle's tokens."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(trace), 1, figsize=(11, 1.8 * len(trace) + 0.6), sharex=True, squeeze=False)
    needle = sorted({p for a in prompt.spans for s in a for p in s})
    for ax, (layer, t) in zip(axes[:, 0], sorted(trace.items())):
        attn, picked = t["attn"].float(), t["picked"]
        ax.plot(attn.numpy(), lw=0.5, color="0.3")
        ax.scatter(picked.numpy(), attn[picked].numpy(), s=3, color="tab:blue", label="selected")
        for p in needle:
            ax.axvline(p, color="red", lw=0.8, alpha=0.6)
        ax.set_yscale("log")
        ax.set_ylabel(f"layer {layer}", fontsize=8)
    axes[0, 0].plot([], [], color="red", label="needle tokens")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("position")
    fig.suptitle(f"{cfg.model} {prompt.uid} at {length:,} tokens: last query's attention, {cfg.method}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
