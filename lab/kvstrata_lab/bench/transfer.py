"""Does a claim transfer? Every method against bf16 on the family tasks (`calib`, `report`): the
real ratio it held at the lengths it ran, the paired Δ pooled over families and per family, the
worst family, and bf16's right answers it lost and gained — the report's "Transfer" section.

The pooled Δ is stratified by family (the mean over families of the mean paired difference; the
bootstrap resamples instances within each family), so a family with more instances does not
outweigh the others.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from kvstrata_lab.bench.families import SPLITS
from kvstrata_lab.bench.paired import Delta, paired_delta
from kvstrata_lab.bench.results import ReportInput, avg, fmt

FLOOR = -0.03  # the bar: a spec holds when every family's lower 95 % bound is >= -3 points
#: and, where rows carry the answer-likelihood measure (`kvstrata_lab.bench.likelihood`):
DLL_FLOOR = -0.05  # nats per answer token: the lower 95 % bound of ΔLL vs bf16 a method must keep
KL_CEILING = 0.05  # nats: the mean answer-token KL(bf16 || method) a method may reach
REFERENCE = "bf16"


def family_scores(rows: list[dict], method: str, split: str) -> dict[tuple[str, int], float]:
    """{(text family, index): score} of one method's scored rows of one split."""
    return {(r["text_family"], r["index"]): r["score"] for r in rows
            if r["method"] == method and r["task"] == split and r.get("score") is not None}


def compare(rows: list[dict], method: str, split: str) -> dict | None:
    """`method` vs bf16 on one split's instances both scored: pooled and per-family Δ, real ratio."""
    a, b = family_scores(rows, method, split), family_scores(rows, REFERENCE, split)
    pooled = paired_delta(a, b)
    if pooled is None:
        return None
    fams = sorted({k[0] for k in a.keys() & b.keys()})
    per = {f: paired_delta(_only(a, f), _only(b, f)) for f in fams}
    mine = [r for r in rows if r["method"] == method and r["task"] == split and "compression" in r]
    shared = a.keys() & b.keys()
    fit = answer_fit(rows, method, split, shared)
    return {
        "method": method, "split": split, "pooled": pooled, "per_family": per,
        "worst": min(per, key=lambda f: (per[f].lo, per[f].mean)),
        "compression": avg([r["compression"] for r in mine]),
        "kv_bytes_per_token": avg([r["kv_bytes_per_token"] for r in mine]),
        "lengths": _span([r["context_tokens"] for r in mine]),
        "right": sum(a[k] >= 1 for k in shared), "bf16_right": sum(b[k] >= 1 for k in shared),
        "lost": sum(b[k] >= 1 > a[k] for k in shared), "gained": sum(a[k] >= 1 > b[k] for k in shared),
        "holds_accuracy": all(d.lo >= FLOOR for d in per.values()), **fit,
        # the likelihood half where measured (older rows: accuracy alone)
        "holds": all(d.lo >= FLOOR for d in per.values()) and fit.get("holds_likelihood", True),
    }


def answer_fit(rows: list[dict], method: str, split: str, keys) -> dict:
    """The answer-likelihood measure over the instances `keys` (`kvstrata_lab.bench.likelihood`): ΔLL
    per answer token vs bf16 (stratified by family, 95 % interval), answer-token KL mean and 99th
    percentile, same-top share; empty where the rows predate the measure."""
    mine = {(r["text_family"], r["index"]): r for r in rows
            if r["method"] == method and r["task"] == split and "answer_dll" in r}
    mine = {k: r for k, r in mine.items() if k in keys}
    if not mine:
        return {}
    dll = paired_delta({k: r["answer_dll"] for k, r in mine.items()}, dict.fromkeys(mine, 0.0))
    kls = np.concatenate([np.asarray(r["answer_kl"], dtype=float) for r in mine.values()])
    tokens = sum(r["answer_tokens"] for r in mine.values())
    same = sum(r["answer_same_top"] * r["answer_tokens"] for r in mine.values()) / tokens
    holds = dll.lo >= DLL_FLOOR and kls.mean() <= KL_CEILING
    return {"dll": dll, "kl_mean": float(kls.mean()), "kl_p99": float(np.percentile(kls, 99)),
            "same_top": same, "holds_likelihood": holds}


def _only(scores: dict, fam: str) -> dict:
    return {k: v for k, v in scores.items() if k[0] == fam}


def _span(values: list[int]) -> tuple[int, int] | None:
    return (min(values), max(values)) if values else None


def comparisons(rows: list[dict]) -> dict[tuple[str, int, str], list[dict]]:
    """{(model, length, split): [comparison per method]} for every cell with family rows."""
    cells = defaultdict(list)
    for r in rows:
        if r.get("task") in SPLITS and not r.get("error"):
            cells[(r["model"], r["length"], r["task"])].append(r)
    out = {}
    for key, rs in sorted(cells.items()):
        methods = [m for m in dict.fromkeys(r["method"] for r in rs) if m != REFERENCE]
        found = [c for m in methods if (c := compare(rs, m, key[2])) is not None]
        if found:
            out[key] = found
    return out


def points(d: Delta) -> str:
    """`+5 [-2, +12]`: a Δ in points with its interval."""
    pts = lambda v: f"{round(v * 100):+d}"  # noqa: E731
    return f"{pts(d.mean)} [{pts(d.lo)}, {pts(d.hi)}]"


def markdown(found: dict[tuple[str, int, str], list[dict]]) -> str:
    """One table per (model, length, split): the rows a claim is read from."""
    if not found:
        return ""
    out = ["## Transfer: the family tasks\n",
           "Each method against bf16 on the same family instances (`report`: what claims are read from; "
           "`calib`: what tuning and screening chose on). Ratio: bf16's bytes ÷ the bytes the method held, "
           "per token, at the lengths it ran (groups, tails, sinks and reservations counted). Δ in points, "
           "paired, 95 % bootstrap interval, pooled = mean over families. ΔLL: the reference answer's "
           "log-likelihood per answer token minus under bf16's cache (nats, 95 % interval); KL: "
           "KL(bf16 ‖ method) over the answer tokens, mean / 99th percentile; same top: share of answer "
           f"tokens whose top choice is bf16's. *holds*: every family's lower bound ≥ −3 points and, where "
           f"measured, ΔLL's lower bound ≥ {DLL_FLOOR} and mean KL ≤ {KL_CEILING}.\n"]
    for (model, length, split), comps in found.items():
        fams = sorted({f for c in comps for f in c["per_family"]})
        lo, hi = comps[0]["lengths"] or (0, 0)
        n = comps[0]["pooled"].n
        out.append(f"### {model}, ≤ {length} tokens ({lo}–{hi} fed), `{split}` families, n = {n}\n")
        out.append("| method | real ratio | right (bf16) | lost / gained | Δ pooled | worst family | "
                   + " | ".join(f"Δ {f}" for f in fams) + " | ΔLL | KL mean / p99 | same top | holds |")
        out.append("|---|---|---|---|---|---|" + "---|" * len(fams) + "---|---|---|---|")
        for c in comps:
            cells = [points(c["per_family"][f]) if f in c["per_family"] else "–" for f in fams]
            head = (f"| `{c['method']}` | {fmt(c['compression'])}× | {c['right']} ({c['bf16_right']}) | "
                    f"{c['lost']} / {c['gained']} | {points(c['pooled'])} | {c['worst']} | ")
            fit = "– | – | –"
            if "dll" in c:
                fit = (f"{c['dll'].mean:+.3f} [{c['dll'].lo:+.3f}, {c['dll'].hi:+.3f}] | "
                       f"{c['kl_mean']:.4f} / {c['kl_p99']:.3f} | {c['same_top']:.0%}")
            out.append(head + " | ".join(cells) + f" | {fit} | {'yes' if c['holds'] else 'no'} |")
        out.append("")
    return "\n".join(out)


def report_section(given: ReportInput) -> str:
    return markdown(comparisons(given.rows))
