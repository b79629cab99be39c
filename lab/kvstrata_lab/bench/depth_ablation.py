"""`kvstrata depth-ablation`: FreqDepthKV's knobs (G, F, r, tolerance, normalisation, forced mode)
swept on one real model through the benchmark's own cells (single-needle retrieval + fidelity),
so the report can say why depth sharing does or does not reach its targets, and what the best
frontier is.

Rows land in `OUT/depth-ablation/results.jsonl` (the bench format, resumable); the main report
renders them as its own section.
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.codecs import spec_of
from kvstrata.codecs.depth import MODES
from kvstrata.methods import parse_method
from kvstrata_lab.bench.results import ReportInput, fmt, load_rows, summarise
from kvstrata_lab.bench.runner import BenchConfig

#: bf16 first (the reference), then forced modes (what sharing alone costs), then the probe's
#: tolerance, then the best candidates on top of FP4.
GRID = (
    "bf16",
    "depth:g=2,f=1,mode=shared",
    "depth:g=2,f=1,mode=shared,norm=1",
    "depth:g=4,f=2,mode=shared",
    "depth:g=4,f=1,mode=shared",
    "depth:g=4,f=1,mode=shared,norm=1",
    "depth:g=4,f=1,r=0.05,mode=residual",
    "depth:g=4,f=1,r=0.25,mode=residual",
    "depth:g=4,f=1,r=0.05,tol=0.3",
    "depth:g=4,f=1,r=0.05,tol=1",
    "depth:g=2,f=1,r=0.05,tol=0.3",
    "depth:g=2,f=1,r=0.05,tol=0.3+nvfp4",
    "nvfp4",
)
TASKS = ("single", "fidelity")
COLOURS = ("tab:green", "tab:orange", "tab:gray")  # shared, residual, exact (MODES order)
SUBDIR = "depth-ablation"


def config(model: str, length: int, n: int, out: Path, methods: tuple[str, ...] = GRID) -> BenchConfig:
    """The bench config of one ablation run (its own results directory under `out`)."""
    return BenchConfig(
        models=(model,), lengths=(length,), tasks=TASKS, methods=methods, n=n, out=Path(out) / SUBDIR
    )


def _knobs(method: str) -> dict:
    full = parse_method(method).full
    cfg = full.depth
    if cfg is None:
        return {"codec": spec_of(full.codec)}
    return {
        "g": cfg.g, "f": cfg.f, "r": cfg.r if cfg.mode in ("probe", "residual") else None,
        "tol": cfg.tol if cfg.mode == "probe" else None, "norm": cfg.norm, "mode": cfg.mode,
        "codec": spec_of(full.codec),
    }


def _modes(rows: list[dict]) -> str:
    """The probe's head decisions (shared / residual / exact counts of the first instance)."""
    first = next((r["head_modes"] for r in rows if r.get("head_modes")), None)
    if not first:
        return "–"
    return " / ".join(str(first.get(m, 0)) for m in MODES)


def _shares(method: str, rows: list[dict]) -> bool:
    """Whether the probe or the forced mode left some head shared or residual (not all exact)."""
    return any(
        r.get("head_modes", {}).get(m) for r in rows if r["method"] == method for m in MODES if m != "exact"
    )


def frontier(methods: dict, ref: dict, slack: float) -> tuple[str, dict] | None:
    """The most compressed method whose single-needle retrieval is within `slack` of bf16's."""
    ok = [
        (m, s)
        for m, s in methods.items()
        if m != "bf16"
        and s["per_task"].get("single") is not None
        and s["per_task"]["single"] >= ref["per_task"]["single"] - slack
    ]
    return max(ok, key=lambda ms: ms[1]["compression"]) if ok else None


def plot_modes(rows: list[dict], path: Path) -> Path | None:
    """Heat map per probed method: depth group x KV head, coloured by the mode the probe fixed
    (first instance's decisions). None when no row carries a map."""
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)
    from matplotlib.colors import ListedColormap  # optional dependency (the bench extra)

    maps = {}
    for r in rows:
        if r.get("head_mode_map") and r["method"] not in maps:
            maps[r["method"]] = r["head_mode_map"]
    probed = {m: g for m, g in maps.items() if _knobs(m).get("mode") == "probe"}
    maps = probed or maps  # forced modes are uniform: plot the probe's choices when there are any
    if not maps:
        return None
    fig, axes = plt.subplots(1, len(maps), figsize=(2.2 + 1.6 * len(maps), 3.2), squeeze=False)
    cmap = ListedColormap(list(COLOURS))
    for ax, (method, groups) in zip(axes[0], maps.items()):
        grid = [[MODES.index(m) for m in g["modes"]] for g in groups]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto")
        ax.set_yticks(range(len(groups)), [f"{g['layers'][0]}-{g['layers'][-1]}" for g in groups], fontsize=6)
        ax.set_xticks(range(len(grid[0])))
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_title(method.replace("depth:", ""), fontsize=6)
    axes[0][0].set_ylabel("layers of the group", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS]
    fig.legend(handles, MODES, loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_section(given: ReportInput) -> str:
    """The report's ablation section from `out/depth-ablation/results.jsonl` ('' if not run)."""
    path = given.out / SUBDIR
    if not (path / "results.jsonl").exists():
        return ""
    rows = load_rows(path, given.skip_bad)
    lines = [
        "## FreqDepthKV ablation\n",
        "Each knob of depth sharing on its own, on the benchmark's single-needle and fidelity cells "
        "(`kvstrata depth-ablation --model MODEL --length L --n N --out DIR`). Modes: `shared` keeps only "
        "the F lowest depth-DCT coefficients of each group of G layers, `residual` adds the top-r tokens' "
        "high-frequency residual, `probe` picks per KV head the cheapest mode within the tolerance (head "
        "decisions: shared / residual / exact).\n",
    ]
    for (model, length), s in summarise(rows).items():
        ref = s["methods"].get("bf16")
        mine = [x for x in rows if x["model"] == model and x["length"] == length]
        lines += [
            f"### {model}, {length} tokens ({s['n']} instances)\n",
            "| method | G | F | r | tol | norm | mode | codec | B/token | × smaller | single | KL | top-1 "
            "| Δppl | heads s / r / e |",
            "|" + "---|" * 15,
        ]
        for m, r in sorted(s["methods"].items(), key=lambda kv: kv[1]["compression"]):
            k = _knobs(m)
            cells = [
                f"`{m}`", *("–" if k.get(x) is None else str(k[x]) for x in ("g", "f", "r", "tol")),
                "yes" if k.get("norm") else "–", k.get("mode", "–"), k["codec"],
                fmt(r["kv_bytes_per_token"], "{:,.0f}"), fmt(r["compression"]),
                fmt(r["per_task"].get("single")), fmt(r["kl"], "{:.4f}"), fmt(r["top1"]),
                fmt(r["ppl_change"], "{:+.2%}"), _modes([x for x in mine if x["method"] == m]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        png = plot_modes(mine, path / f"head_modes_{model}_{length}.png")
        if png is not None:
            lines += [
                "", "The probe's fixed decisions per depth group and KV head:", "",
                f"![head modes]({SUBDIR}/{png.name})",
            ]
        if ref:
            lines.append("")
            depth = {m: r for m, r in s["methods"].items() if _shares(m, mine)}
            for label, pool in (
                ("method that shares depth (some head not exact)", depth), ("method here", s["methods"]),
            ):
                for slack in (0.01, 0.02):
                    found = frontier(pool, ref, slack)
                    lines.append(
                        f"Most compressed {label} with single-needle retrieval within {slack * 100:.0f} "
                        "point(s) of bf16: "
                        + (
                            f"`{found[0]}` at {found[1]['compression']:.2f}× (top-1 {fmt(found[1]['top1'])})."
                            if found
                            else "none."
                        )
                        + "\n"
                    )
    return "\n".join(lines)
