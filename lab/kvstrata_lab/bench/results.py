"""Benchmark results as data: reading `results.jsonl` (and the sections' own JSONL files) and
summarising rows per model and length. The report and every experiment's section read through here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from kvstrata_lab.bench.rows import read_rows
from kvstrata_lab.bench.tasks import FAMILY_TASKS, FIDELITY, LOOKALIKE, REASON_TASKS, REASONING, RETRIEVAL

FAMILY_COLOURS = {
    "reference": "black", "quantization": "tab:blue", "eviction": "tab:orange",
    "eviction+quant": "tab:green", "depth": "tab:purple", "sparse-read": "tab:red", "peer": "tab:gray",
}
USABLE = 0.5  # a task the uncompressed reference scores below this on is not used to rank methods
#: the family tasks pool phrasings, answer kinds and lookalike distractors and are harder by design;
#: a paired Δ counts every instance bf16 answers, so they rank methods from a lower bar
FAMILY_USABLE = 0.25
#: the tasks whose scores rank methods (the retrieval mean, the frontier, the headline's speed)
RANKED_TASKS = RETRIEVAL + FAMILY_TASKS


def load_rows(out: Path, skip_bad: bool = False) -> list[dict]:
    """The rows of `out/results.jsonl`; bad rows refused (`rows.BadRows`) unless `skip_bad`."""
    return load_results(out, skip_bad)[0]


def load_results(out: Path, skip_bad: bool) -> tuple[list[dict], int]:
    path = out / "results.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{out} holds no benchmark results ({path.name} is missing): run `kvstrata "
                                f"bench --out {out}` first")
    return read_rows(path, skip_bad)


def load_meta(out: Path) -> dict:
    """A bench directory's meta.json: its runs' settings (`runs`) and the report's decode source
    (`decode_from`); {} when there is none."""
    path = out / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_meta(out: Path, meta: dict) -> None:
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def avg(values):
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def summarise(rows: list[dict]) -> dict:
    """{(model, length): {"methods": {method: summary}, "usable": {task: bool}, "tasks": [...]}}"""
    groups = defaultdict(list)
    for r in rows:
        if r.get("error"):
            continue  # a peer's failure: listed by `failures`, not scored
        groups[(r["model"], r["length"])].append(r)
    out = {}
    for key, rs in sorted(groups.items()):
        order = RANKED_TASKS + LOOKALIKE + REASONING + REASON_TASKS + FIDELITY
        tasks = sorted({r["task"] for r in rs}, key=order.index)
        ref = [r for r in rs if r["method"] == "bf16"]
        rs = rs + reference_subsets(rs, ref)
        usable = {t: usable_score(avg([r["score"] for r in ref if r["task"] == t]) or 0, t)
                  for t in tasks if t not in FIDELITY}
        methods = {}
        names = list(dict.fromkeys(r["method"] for r in rs))
        # failures are compared over the tasks every method ran (extra methods may skip some)
        common = set.intersection(*({r["task"] for r in rs if r["method"] == m} for m in names))
        for m in names:
            mr = [r for r in rs if r["method"] == m]
            per_task = {t: avg([r["score"] for r in mr if r["task"] == t]) for t in tasks}
            ranked = [per_task[t] for t in tasks if t in RANKED_TASKS and usable.get(t)]
            fid = [r for r in mr if r["task"] in FIDELITY]
            costed = [r for r in mr if r["task"] not in FIDELITY] or fid
            per_count = counts(mr)
            methods[m] = {
                "family": mr[0]["family"],
                "n": min(per_count),
                "n_max": max(per_count),
                # bytes and ×smaller from the same rows: the question rows (the bytes a user holds
                # while asking), the fidelity rows only where a method ran nothing else
                "kv_bytes_per_token": avg([r["kv_bytes_per_token"] for r in costed]),
                "compression": avg([r["compression"] for r in costed]),
                "retrieval": avg(ranked),
                "per_task": per_task,
                "fail_retrieval": sum(r["failure"] == "retrieval" for r in mr if r["task"] in common),
                "fail_reasoning": sum(r["failure"] == "reasoning" for r in mr if r["task"] in common),
                "kl": avg([r.get("kl") for r in fid]),
                "top1": avg([r.get("top1") for r in fid]),
                "ppl_change": avg([r["ppl"] / r["ref_ppl"] - 1 for r in fid]) if fid else None,
                "bytes_read_per_step": avg(
                    [r["bytes_read_per_step"] for r in mr if r["task"] not in FIDELITY]
                ),
                "prefill_s": avg([r["prefill_s"] for r in mr]),
                "compress_s": avg([r["compress_s"] for r in mr]),
                "decode_s_per_token": avg([r["decode_s_per_token"] for r in mr]),
                "busy": sum(busy(r) for r in mr),  # rows timed while other work loaded the machine
                "peak_rss_mb": max(r["peak_rss_mb"] for r in mr),
            }
        out[key] = {
            "methods": methods, "usable": usable, "tasks": tasks, "n": max(count(rs, t) for t in tasks),
            "common": sorted(common - set(FIDELITY)), "fed": fed_lengths(rs),
        }
    return out


def busy(row: dict) -> bool:
    """Whether a row was timed on a busy machine: its 1-minute load average above the machine's cores
    (the bench alone keeps it at most at its threads); rows from before loads were recorded are not."""
    load, cores = row.get("load_1m"), row.get("cores")
    return load is not None and bool(cores) and load > cores


def load_note(rows: list[dict]) -> str:
    """One line on the machine's load while the rows were timed ('' when none recorded it)."""
    loads = sorted(r["load_1m"] for r in rows if r.get("load_1m") is not None)
    if not loads:
        return ""
    cores = max(r.get("cores") or 0 for r in rows)
    n = sum(map(busy, rows))
    median = loads[len(loads) // 2]
    said = (f"Machine load while timing (1-minute average, {cores} cores): median {median:.1f}, "
            f"max {loads[-1]:.1f}.")
    if n:
        said += (f" **{n} of {len(rows)} rows were timed on a busy machine** (load above its cores: other "
                 "work ran beside the bench); their times are marked † -- rerun them alone before comparing.")
    return said + "\n"


def usable_score(score: float, task: str) -> bool:
    """Whether the reference's `score` on `task` is high enough to rank methods on it."""
    return score >= (FAMILY_USABLE if task in FAMILY_TASKS else USABLE)


QUESTION_TASKS = RANKED_TASKS + LOOKALIKE + REASONING + REASON_TASKS


def fed_lengths(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """Min and max context tokens actually fed, for question tasks (context only; the question follows)
    and for fidelity: the lengths the rows ran at, beside the nominal one they are filed under."""
    out = {}
    for kind, tasks in (("questions", QUESTION_TASKS), ("fidelity", FIDELITY)):
        fed = [r["context_tokens"] for r in rows if r["task"] in tasks and "context_tokens" in r]
        if fed:
            out[kind] = (min(fed), max(fed))
    return out


def reference_subsets(rs: list[dict], ref: list[dict]) -> list[dict]:
    """`bf16 (first N)` rows: the reference on the first N instances, for every method run on fewer
    instances than the reference (instance i is the same context for every method), so such a
    method is read against the reference on its own instances."""
    if not ref:
        return []
    full = max(counts(ref))
    by_method = defaultdict(list)
    for r in rs:
        by_method[r["method"]].append(r)
    fewer = {min(counts(mr)) for mr in by_method.values()}
    return [
        dict(r, method=f"bf16 (first {n})")
        for n in sorted(k for k in fewer if k < full)
        for r in ref
        if r["index"] < n
    ]


def count(rs, task):
    return len({r["index"] for r in rs if r["task"] == task})


def counts(rs) -> list[int]:
    """Instances per task, over the tasks `rs` covers."""
    return [count(rs, t) for t in {r["task"] for r in rs}]


def fmt(v, pattern="{:.2f}"):
    """A number for a table cell; `–` when it was not measured."""
    return "–" if v is None else pattern.format(v)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file an experiment wrote ([] when it has not run)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class ReportInput:
    """What every report section is handed: the results directory, its rows and their summary."""

    out: Path
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    skip_bad: bool = False


def mark_frontier(points: list[dict], cost: str, value: str, same: float = 1e-3) -> None:
    """Set `frontier` on each point: True when no other point costs no more and scores no less,
    better in one of the two (points without a value are never on it; costs within `same` of each
    other, relatively, count as equal: 6,480 and 6,479.6 bytes per token are the same bytes)."""
    scored = [p for p in points if p[value] is not None]
    for p in points:
        p["frontier"] = p[value] is not None and not any(
            o[cost] <= p[cost] * (1 + same) and o[value] >= p[value]
            and (o[cost] < p[cost] * (1 - same) or o[value] > p[value])
            for o in scored
        )
