"""The shape of a benchmark row (one line of results.jsonl) and a reader that refuses bad rows.

Invariant: the report is built only from rows that parse and have the fields it reads, with the
types it expects; a bad row is never silently dropped. `read_rows` names the file, each bad line
and why, and raises unless the caller asks to skip them (then it returns how many it skipped).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvstrata.user_files import read_text_file
from kvstrata_lab.bench.families import SPLITS
from kvstrata_lab.bench.tasks import FIDELITY, KNOWN

ROWS_MAX_BYTES = 1 << 30
SHOWN = 5  # bad lines named in the error message

_NUMBERS = ("score", "kv_bytes_per_token", "compression", "prefill_s", "bytes_read_per_step", "peak_rss_mb")
_OPTIONAL_NUMBERS = ("compress_s", "decode_s_per_token")
_FIDELITY_NUMBERS = ("kl", "top1", "ppl", "ref_ppl")


class BadRows(ValueError):
    """results.jsonl holds lines that are not benchmark rows."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def row_problem(row) -> str | None:
    """Why `row` is not a benchmark row the report can use, or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for name in ("model", "method"):
        if not isinstance(row.get(name), str) or not row[name]:
            return f"field {name!r} must be a non-empty string"
    if row.get("task") not in KNOWN:
        return f"field 'task' must be one of {', '.join(KNOWN)}, got {row.get('task')!r}"
    for name, low in (("length", 1), ("index", 0)):
        value = row.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"field {name!r} must be a whole number >= {low}, got {value!r}"
    if row.get("error"):
        return None if isinstance(row["error"], str) else "field 'error' must be a string"
    wanted = _NUMBERS + (_FIDELITY_NUMBERS if row["task"] in FIDELITY else ())
    for name in wanted:
        if not _number(row.get(name)):
            return f"field {name!r} must be a finite number, got {row.get(name)!r}"
    for name in _OPTIONAL_NUMBERS:
        if row.get(name) is not None and not _number(row[name]):
            return f"field {name!r} must be a finite number or null, got {row[name]!r}"
    if row.get("failure") is not None and not isinstance(row["failure"], str):
        return f"field 'failure' must be a string or null, got {row['failure']!r}"
    if row["task"] in SPLITS and not isinstance(row.get("text_family"), str):
        return f"field 'text_family' must be a string on a {row['task']} row, got {row.get('text_family')!r}"
    if not isinstance(row.get("family"), str):
        return f"field 'family' must be a string, got {row.get('family')!r}"
    return None


def read_rows(path: Path, skip_bad: bool = False) -> tuple[list[dict], int]:
    """(rows, skipped) from a results.jsonl; raises BadRows naming its bad lines unless `skip_bad`."""

    rows, bad = [], []
    for number, line in enumerate(read_text_file(path, str(path), ROWS_MAX_BYTES).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append((number, f"not JSON ({exc.msg})"))
            continue
        problem = row_problem(row)
        if problem:
            bad.append((number, problem))
        else:
            rows.append(row)
    if bad and not skip_bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:SHOWN])
        more = f"; and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise BadRows(f"{path}: {len(bad)} bad row(s) ({shown}{more}); fix them, or pass --skip-bad to leave "
                      "them out")
    return rows, len(bad)


def row_key(row: dict) -> tuple:
    """What identifies a row: one method on one instance of one task at one model and length."""
    return row["model"], row["length"], row["task"], row["index"], row["method"]


def done_keys(path: Path) -> set[tuple]:
    """The keys of the rows `path` holds (none if it does not exist); a line cut by an interrupted
    run is not done (the bench redoes it)."""
    keys = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                keys.add(row_key(json.loads(line)))
            except json.JSONDecodeError:
                continue
    return keys
