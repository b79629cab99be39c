"""`kvstrata check-lengths DIR`: the benchmark rows whose context was not fed at their nominal length.

A row is filed under a nominal `length`; its `context_tokens` is what was fed. A question task's
context plus its question should fill the length and a fidelity context is the length itself, so a
row may differ from its length by at most its question's tokens plus the tokenizer's special tokens
(`kvstrata_lab.bench.tasks.check_fed`, which the runner now enforces). Rows written before rows recorded
their question's tokens get them from the task's question drawn again (the same question for every
task but `multikey`, whose asked key was drawn later then: at most a word's tokens apart).

`--drop` moves the offending rows to `DIR/short-rows.jsonl`; rerunning the bench commands that wrote
them (the bench is resumable) then redoes exactly those rows, and `pending` says which are still to redo.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvstrata_lab.bench.haystack import special_tokens
from kvstrata_lab.bench.results import load_meta
from kvstrata_lab.bench.rows import done_keys, read_rows, row_key
from kvstrata_lab.bench.tasks import FIDELITY, draw, question_tokens

MOVED = "short-rows.jsonl"


@dataclass(frozen=True)
class Off:
    """One row fed at a length its nominal length does not allow."""

    row: dict
    allowed: int  # question + special tokens

    @property
    def short(self) -> int:
        return self.row["length"] - self.row["context_tokens"]


def allowance(row: dict, tokenizer, seed: int) -> int:
    """Tokens by which `row`'s fed context may differ from its nominal length."""
    if "question_tokens" in row:
        return row["question_tokens"] + row["special_tokens"]
    if row["task"] in FIDELITY:
        q = 0
    else:
        _, _, questions, _ = draw(row["task"], row["length"], row["index"], seed)
        q = question_tokens(tokenizer, questions)
    return q + special_tokens(tokenizer)


def off_rows(rows: list[dict], load_tokenizer, seed: int = 0) -> list[Off]:
    """The rows whose context differs from their nominal length by more than their allowance."""
    tokenizers: dict[str, object] = {}
    out = []
    for r in rows:
        if "question_tokens" not in r and r["model"] not in tokenizers:
            tokenizers[r["model"]] = load_tokenizer(r["model"])
        allowed = allowance(r, tokenizers.get(r["model"]), seed)
        if abs(r["length"] - r["context_tokens"]) > allowed:
            out.append(Off(r, allowed))
    return out


def table(off: list[Off]) -> str:
    """Markdown: per model, length, task and method, the instances off and by how much."""
    groups = defaultdict(list)
    for o in off:
        r = o.row
        groups[(r["model"], r["length"], r["task"], r["method"])].append(o)
    span = lambda xs: f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}–{max(xs)}"  # noqa: E731
    lines = ["| model | length | task | method | instances | tokens short | allowed | beyond allowed |",
             "|---|---|---|---|---|---|---|---|"]
    for (model, length, task, method), group in sorted(groups.items()):
        idx = sorted(o.row["index"] for o in group)
        lines.append(f"| {model} | {length} | {task} | `{method}` | {len(idx)} ({_ranges(idx)}) | "
                     f"{span([o.short for o in group])} | {span([o.allowed for o in group])} | "
                     f"{span([abs(o.short) - o.allowed for o in group])} |")
    return "\n".join(lines) + "\n"


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2, 5'."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}–{a}")
            start = b
    return ", ".join(out)


def check(out: Path, load_tokenizer, drop: bool = False, seed: int | None = None) -> tuple[list[Off], int]:
    """(rows off their nominal length, rows read) of `out/results.jsonl`; with `drop`, move the rows
    off to `out/short-rows.jsonl` (appended) and keep the rest in place."""
    path = out / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{out} holds no benchmark results ({path.name} is missing)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = [_row(line) for line in lines]  # None: a line cut by an interrupted run (the bench redoes it)
    off = off_rows([r for r in rows if r is not None], load_tokenizer, _seed(out) if seed is None else seed)
    if drop and off:
        ids = {id(o.row) for o in off}
        with (out / MOVED).open("a") as f:
            f.writelines(line + "\n" for line, r in zip(lines, rows) if id(r) in ids)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line, r in zip(lines, rows) if id(r) not in ids))
        os.replace(tmp, path)
    return off, sum(r is not None for r in rows)


def pending(out: Path) -> tuple[int, list[dict]]:
    """(rows moved to `out/short-rows.jsonl`, those of them with no row in `out/results.jsonl` yet)."""
    moved = read_rows(out / MOVED, skip_bad=True)[0] if (out / MOVED).is_file() else []
    done = done_keys(out / "results.jsonl")  # what the resumable bench counts as done
    return len(moved), [r for r in moved if row_key(r) not in done]


def pending_table(left: list[dict]) -> str:
    """Markdown: per model, length and method, the tasks and instances still to rerun."""
    groups = defaultdict(list)
    for r in left:
        groups[(r["model"], r["length"], r["method"])].append(r)
    lines = ["| model | length | method | tasks | instances | rows |", "|---|---|---|---|---|---|"]
    for (model, length, method), group in sorted(groups.items()):
        tasks = ", ".join(sorted({r["task"] for r in group}))
        idx = sorted({r["index"] for r in group})
        lines.append(f"| {model} | {length} | `{method}` | {tasks} | {_ranges(idx)} | {len(group)} |")
    return "\n".join(lines) + "\n"


def _row(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _seed(out: Path) -> int:
    """The seed the directory's runs used (rows do not record it), from its meta.json."""
    seeds = {run.get("seed", 0) for run in load_meta(out).get("runs", [])}
    if len(seeds) > 1:
        raise ValueError(f"{out / 'meta.json'} lists runs with different seeds {sorted(seeds)}: give --seed")
    return seeds.pop() if seeds else 0
