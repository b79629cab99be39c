"""The report's "Reasoning beside retrieval" section: per model and reasoning split, each method's
answers per kind, its wrong answers tagged retrieval (a probe of a needed fact failed) or reasoning
(every probe passed), and its paired Δ vs bf16 over the kinds that count on that model (bf16 answers
>= `reasoning.COUNTS_FROM` of them)."""

from __future__ import annotations

from collections import defaultdict

from kvstrata_lab.bench.paired import paired_delta
from kvstrata_lab.bench.reasoning import COUNTS_FROM, KINDS, SPLITS
from kvstrata_lab.bench.results import ReportInput
from kvstrata_lab.bench.transfer import points

REFERENCE = "bf16"


def tables(rows: list[dict]) -> dict[tuple[str, int, str], dict]:
    """{(model, length, split): {"counts": {kind: bool}, "bf16": {kind: share}, "methods": [...]}}."""
    cells = defaultdict(list)
    for r in rows:
        if r.get("task") in SPLITS and not r.get("error") and r.get("score") is not None:
            cells[(r["model"], r["length"], r["task"])].append(r)
    out = {}
    for key, rs in sorted(cells.items()):
        ref = {(r["reason_kind"], r["index"]): r["score"] for r in rs if r["method"] == REFERENCE}
        if not ref:
            continue
        share = {k: _mean([v for (kk, _), v in ref.items() if kk == k]) for k in KINDS}
        counts = {k: share[k] is not None and share[k] >= COUNTS_FROM for k in KINDS}
        methods = []
        for m in dict.fromkeys(r["method"] for r in rs):
            mr = [r for r in rs if r["method"] == m]
            mine = {(r["reason_kind"], r["index"]): r["score"] for r in mr}
            counted = {k: v for k, v in mine.items() if counts[k[0]]}
            base = {k: v for k, v in ref.items() if counts[k[0]]}
            delta = paired_delta(counted, base) if m != REFERENCE else None
            methods.append({
                "method": m, "n": len(mr),
                "per_kind": {k: _mean([v for (kk, _), v in mine.items() if kk == k]) for k in KINDS},
                "retrieval": sum(r["failure"] == "retrieval" for r in mr),
                "reasoning": sum(r["failure"] == "reasoning" for r in mr),
                "delta": delta,
            })
        out[key] = {"counts": counts, "bf16": share, "methods": methods}
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def markdown(found: dict) -> str:
    if not found:
        return ""
    out = ["## Reasoning beside retrieval\n",
           "The reasoning families (a step after the lookup: two-hop, the larger of two values, a sum, a "
           "variable through a reassignment), each wrong answer tagged from its probes: *retrieval* (a "
           "probe of a needed fact failed) or *reasoning* (every probe passed, the step failed). A kind "
           f"counts on a model where bf16 answers ≥ {COUNTS_FROM:.0%} of it; Δ vs bf16 (points, paired, 95 % "
           "interval) over the kinds that count; a kind that does not count is shown in parentheses.\n"]
    for (model, length, split), t in found.items():
        counted = [k for k in KINDS if t["counts"][k]]
        out.append(f"### {model}, ≤ {length} tokens, `{split}`; counting: {', '.join(counted) or 'none'}\n")
        out.append("| method | n | " + " | ".join(KINDS) + " | wrong: retrieval / reasoning | Δ (counted) |")
        out.append("|---|---|" + "---|" * len(KINDS) + "---|---|")
        for m in t["methods"]:
            cells = []
            for k in KINDS:
                v = m["per_kind"][k]
                text = "–" if v is None else f"{v:.0%}"
                cells.append(text if t["counts"][k] else f"({text})")
            d = m["delta"]
            dtext = "–" if d is None else points(d)
            out.append(f"| `{m['method']}` | {m['n']} | " + " | ".join(cells)
                       + f" | {m['retrieval']} / {m['reasoning']} | {dtext} |")
        out.append("")
    return "\n".join(out)


def report_section(given: ReportInput) -> str:
    return markdown(tables(given.rows))
