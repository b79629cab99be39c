"""Quality per byte: every method and peer at one model and length, stored bytes per token against
retrieval, the frontier marked and the targets drawn; each method's difference from bf16 is paired
on the instances both ran, with a 95 % bootstrap interval (`kvstrata_lab.bench.paired`).
"""

from __future__ import annotations

from pathlib import Path

from kvstrata_lab.bench.labels import place_labels
from kvstrata_lab.bench.paired import Delta, paired_delta, scores_by_instance
from kvstrata_lab.bench.results import FAMILY_COLOURS, RANKED_TASKS, ReportInput, fmt, mark_frontier

REFERENCE = "bf16"
#: (compression vs bf16, allowed retrieval drop vs bf16, top-1 floor, label): the quality-per-byte
#: targets; the first is at the `nvfp4` row's own bytes where there is one
TARGETS = ((3.56, 0.01, 0.97, "NVFP4's bytes, within 1 pt, top-1 ≥ 0.97"),
           (6.0, 0.01, 0.0, "6×, within 1 pt"), (8.0, 0.03, 0.90, "8×, within 3 pts, top-1 ≥ 0.90"))
NVFP4 = "nvfp4"


def budgets(pts: list[dict]) -> list[tuple[float, float, float, str]]:
    """(bytes per token, allowed drop, top-1 floor, label) per target."""
    ref = next(p for p in pts if p["method"] == REFERENCE)
    nv = next((p["bytes"] for p in pts if p["method"] == NVFP4), None)
    return [((nv if i == 0 and nv else ref["bytes"] / ratio), slack, floor, label)
            for i, (ratio, slack, floor, label) in enumerate(TARGETS)]


def points(given: ReportInput) -> dict[tuple[str, int], list[dict]]:
    """Per (model, length) with a bf16 row: one point per method and peer."""
    out = {}
    for key, s in given.summary.items():
        if REFERENCE not in s["methods"]:
            continue
        usable = [t for t in RANKED_TASKS if s["usable"].get(t)]
        rows = [r for r in given.rows if (r["model"], r["length"]) == key and not r.get("error")]
        ref = scores_by_instance(rows, REFERENCE, usable)
        pts = []
        for m, summ in s["methods"].items():
            if m.startswith(f"{REFERENCE} (first"):
                continue  # the reference on a subset: the pairing below does that job
            mine = scores_by_instance(rows, m, usable)
            pts.append({
                "method": m, "family": summ["family"], "bytes": summ["kv_bytes_per_token"],
                "compression": summ["compression"], "retrieval": summ["retrieval"], "top1": summ["top1"],
                "n": summ["n"], "delta": None if m == REFERENCE else paired_delta(mine, ref),
                # retrieval means compare only over the same questions: a row scored on other
                # instances or tasks than the reference is shown, paired, and not ranked or judged
                "ranked": mine.keys() == ref.keys(),
            })
        mark_frontier([p for p in pts if p["ranked"]], "bytes", "retrieval")
        for p in pts:
            p.setdefault("frontier", False)
        out[key] = sorted(pts, key=lambda p: -p["bytes"])
    return out


def _delta_cell(d: Delta | None) -> str:
    return "–" if d is None else d.text()


def _frontier_cell(p: dict) -> str:
    """★ on the frontier; `n ≠` for a scored row left unranked (other questions than bf16's)."""
    if p["frontier"]:
        return "★"
    return "" if p["ranked"] or p["retrieval"] is None else "n ≠"


def target_lines(pts: list[dict]) -> list[str]:
    """Per target: the cheapest method that meets it on its paired instances, or how far the
    closest one is (a target is met when the paired drop's point estimate is within the slack and
    top-1, where the target has a floor, was measured and reaches it). Only rows scored on every
    question the reference was are judged: the targets are stated on all of them."""
    lines = []
    for budget, slack, floor, label in budgets(pts):
        within = [p for p in pts if p["bytes"] <= budget and p["delta"] is not None]  # 1 B over is over
        fits = [p for p in within if p["ranked"]]
        met = [p for p in fits if p["delta"].mean >= -slack and (not floor or (p["top1"] or 0) >= floor)]
        if met:
            best = max(met, key=lambda p: p["compression"])
            lines.append(f"- {label} (≤ {budget:,.0f} B/token): met by `{best['method']}` "
                         f"({best['compression']:.2f}×, Δ {best['delta'].text()}; vs bf16: "
                         f"{best['delta'].verdict()}).")
        elif fits:
            best = max(fits, key=lambda p: p["delta"].mean)
            lines.append(f"- {label} (≤ {budget:,.0f} B/token): not met; closest `{best['method']}` "
                         f"Δ {best['delta'].text()}, top-1 {fmt(best['top1'], '{:.3f}')}; vs bf16: "
                         f"{best['delta'].verdict()}.")
        elif within:
            lines.append(f"- {label} (≤ {budget:,.0f} B/token): not judged; only rows scored on other "
                         f"questions than bf16's are at these bytes ({len(within)}, `n ≠`).")
        else:
            lines.append(f"- {label} (≤ {budget:,.0f} B/token): no method measured at these bytes.")
    return lines


def plot(key: tuple[str, int], pts: list[dict], out: Path) -> Path:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    fig, ax = plt.subplots(figsize=(8, 5))
    scored = [p for p in pts if p["retrieval"] is not None]
    for p in scored:
        colour = FAMILY_COLOURS.get(p["family"], "tab:gray")
        ax.scatter(p["bytes"], p["retrieval"], marker="*" if p["frontier"] else "o",
                   s=90 if p["frontier"] else 30, zorder=3, edgecolors=colour,
                   facecolors=colour if p["ranked"] else "none")
    # the frontier and the reference are named (the rest in the table beside the plot), after the layout
    named = [(p["bytes"], p["retrieval"], p["method"]) for p in scored
             if p["frontier"] or p["method"] == REFERENCE]
    front = sorted((p for p in scored if p["frontier"]), key=lambda p: p["bytes"])
    ax.step([p["bytes"] for p in front], [p["retrieval"] for p in front], where="post", color="black", lw=0.8)
    ref = next(p for p in pts if p["method"] == REFERENCE)
    for x, slack, _, label in budgets(pts):
        y = (ref["retrieval"] or 0) - slack
        ax.plot([x, x], [y, 1.02], color="tab:red", lw=0.8, ls="--")
        ax.plot([x, ref["bytes"] * 1.1], [y, y], color="tab:red", lw=0.8, ls=":")
        ax.annotate(label, (x, 1.02), fontsize=6, color="tab:red", rotation=90, va="top", ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("stored KV bytes per token (log)")
    ax.set_ylabel("retrieval (usable tasks)")
    ax.set_title(f"{key[0]} @ {key[1]}: quality per byte (★ frontier; hollow: other instances, "
                 "not ranked; red: targets)", fontsize=9)
    fig.tight_layout()
    place_labels(ax, named, fontsize=6)
    path = out / f"frontier_{key[0]}_{key[1]}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_section(given: ReportInput) -> str:
    """Markdown: per model and length, the frontier table, the targets and the plot."""
    found = points(given)
    if not found:
        return ""
    lines = [
        "## Quality per byte\n",
        "Every method and peer against bf16. Δ = retrieval minus bf16's on exactly the instances both "
        "ran, in points, with a 95 % interval from a bootstrap over instances (resampled within each task) "
        "and the number of paired questions; an interval that contains 0 means the data cannot tell the "
        "two apart. ★ = on the frontier (nothing stores fewer bytes and retrieves more); rows scored on "
        "other questions than bf16 (other instances or tasks) are paired but neither ranked nor judged "
        "against the targets (`n ≠` in the frontier column; hollow in the plot).\n",
    ]
    for key, pts in sorted(found.items()):
        lines += [f"### {key[0]}, {key[1]} tokens\n", *target_lines(pts), "",
                  "| method | family | B/token | × smaller | retrieval | Δ vs bf16 [95 % CI] | top-1 "
                  "| frontier |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in pts:
            lines.append(
                f"| `{p['method']}` | {p['family']} | {fmt(p['bytes'], '{:,.0f}')} | "
                f"{fmt(p['compression'])} | {fmt(p['retrieval'])} | {_delta_cell(p['delta'])} | "
                f"{fmt(p['top1'])} | "
                f"{_frontier_cell(p)} |"
            )
        lines.append(f"\n![frontier {key[0]} {key[1]}]({plot(key, pts, given.out).name})\n")
    return "\n".join(lines)
