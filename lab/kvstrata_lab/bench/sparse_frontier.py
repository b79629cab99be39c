"""The sparse-read frontier: for every top-k read method in a results file, the bytes it reads per
decode step (share of the bf16 reference's dense read) beside its retrieval, both on exactly the
instances it ran, the Pareto frontier over k / schedule / indexer, and whether the 8k target
(<= 10 % read, retrieval within 1 point of bf16) is met.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean

from kvstrata.codecs import spec_of
from kvstrata.methods import parse_method
from kvstrata_lab.bench.results import ReportInput, mark_frontier
from kvstrata_lab.bench.tasks import RETRIEVAL

TARGET_READ, TARGET_SLACK, TARGET_LENGTH = 0.10, 0.01, 8192


def knobs(method: str) -> dict:
    """What a sparse-read spec sets: k, schedule, indexer (+ rank), the store codec, depth sharing."""
    full = parse_method(method).full
    cfg = full.read
    indexer = f"{cfg.indexer} r={cfg.rank}" if cfg.indexer == "lowrank" else cfg.indexer
    return {"k": cfg.k, "schedule": cfg.schedule + (" hier" if cfg.hier else ""), "indexer": indexer,
            "store": spec_of(full.codec) + (f" + {spec_of(full.depth)}" if full.depth else "")}


def points(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """Per (model, length): one point per sparse method, scored against bf16 on its own instances."""
    by = defaultdict(list)
    for r in rows:
        if r.get("task") in RETRIEVAL and r.get("score") is not None:
            by[(r["model"], r["length"])].append(r)
    out = {}
    for key, rs in by.items():
        ref = {(r["task"], r["index"]): r for r in rs if r["method"] == "bf16"}
        pts = []
        for m in dict.fromkeys(r["method"] for r in rs if r["family"] == "sparse-read"):
            mine = [r for r in rs if r["method"] == m and (r["task"], r["index"]) in ref]
            if not mine:
                continue
            base = [ref[(r["task"], r["index"])] for r in mine]
            pts.append(
                {
                    "method": m, **knobs(m), "n": len(mine), "tasks": sorted({r["task"] for r in mine}),
                    "read": mean(r["bytes_read_per_step"] for r in mine)
                    / mean(b["bytes_read_per_step"] for b in base),
                    "retrieval": mean(r["score"] for r in mine),
                    "ref": mean(b["score"] for b in base),
                }
            )
        if pts:
            mark_frontier(pts, "read", "retrieval")
            out[key] = sorted(pts, key=lambda p: p["read"])
    return out


def verdict(pts: list[dict], length: int) -> str:
    ok = [p for p in pts if p["read"] <= TARGET_READ and p["retrieval"] >= p["ref"] - TARGET_SLACK]
    near = [p for p in pts if p["retrieval"] >= p["ref"] - TARGET_SLACK]
    best = min(near, key=lambda p: p["read"]) if near else None
    where = "target" if length >= TARGET_LENGTH else "target (set at 8k; shown here for reference)"
    if ok:
        return f"{where} met: " + ", ".join(f"`{p['method']}` ({p['read']:.1%} read)" for p in ok) + "."
    tail = (
        f"the least read within 1 point of bf16 is `{best['method']}` at {best['read']:.1%}."
        if best
        else "no sparse method is within 1 point of bf16."
    )
    return f"{where} not met: " + tail


def plot(key: tuple[str, int], pts: list[dict], out: Path) -> Path:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in pts:
        ax.scatter(
            p["read"], p["retrieval"] - p["ref"], marker="*" if p["frontier"] else "o",
            s=70 if p["frontier"] else 30,
            color="tab:purple"
            if p["indexer"].startswith("lowrank")
            else "tab:blue"
            if p["indexer"] == "lightning"
            else "tab:gray",
        )
        ax.annotate(
            f"{p['schedule']} k={p['k']}", (p["read"], p["retrieval"] - p["ref"]), fontsize=7,
            xytext=(3, 3), textcoords="offset points",
        )
    ax.axvline(TARGET_READ, color="tab:red", lw=0.8, ls="--")
    ax.axhline(-TARGET_SLACK, color="tab:red", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("bytes read per decode step, share of bf16 dense (log)")
    ax.set_ylabel("retrieval − bf16 (same instances)")
    ax.set_title(
        f"{key[0]} @ {key[1]}: sparse reads (★ frontier; grey exact, blue lightning, purple lowrank)"
    )
    fig.tight_layout()
    path = out / f"sparse_{key[0]}_{key[1]}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_section(given: ReportInput) -> str:
    """Markdown for the report (empty when no sparse-read rows exist); writes one plot per model/length."""
    out = given.out
    found = points(given.rows)
    if not found:
        return ""
    lines = [
        "## Sparse reads: bytes read per decode step against retrieval\n",
        "Each top-k method against bf16 on exactly the retrieval instances it ran (`n` questions). `read` "
        "= its bytes read per decode step (index keys scanned + entries gathered, plus layers left dense) "
        "over bf16's dense read on the same instances. ★ = on the frontier (nothing reads less and "
        "retrieves more).\n",
    ]
    for key, pts in sorted(found.items()):
        lines += [
            f"### {key[0]}, {key[1]} tokens\n",
            verdict(pts, key[1]) + "\n",
            "| method | k | schedule | indexer | store | n | tasks | read | retrieval | bf16 | frontier |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in pts:
            lines.append(
                f"| `{p['method']}` | {p['k']} | {p['schedule']} | {p['indexer']} | {p['store']} | {p['n']} "
                f"| {', '.join(p['tasks'])} | {p['read']:.1%} | {p['retrieval']:.2f} | {p['ref']:.2f} | "
                f"{'★' if p['frontier'] else ''} |"
            )
        lines.append(f"\n![sparse {key[0]} {key[1]}]({plot(key, pts, out).name})\n")
    return "\n".join(lines)
