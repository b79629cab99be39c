"""Answers under bf16 weights against float32 weights on the same questions (issue "Models people
run": `--dtype bf16` is compared with the float32 reference on a sample).

Two bench directories of one model, run with `--dtype bf16` and `--dtype float32` (the same seed and
tasks), are paired per (task, instance, method): right answers under each, identical outputs, score
flips and the reference answer's log-likelihood (per token) float32 minus bf16.

    python -m kvstrata_lab.bench.dtype_compare docs/results/qwen docs/results/qwen-f32 \
        --out docs/results/qwen-f32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from kvstrata_lab.bench.results import read_jsonl


def _keyed(rows: list[dict], dtype: str) -> dict[tuple, dict]:
    return {(r["task"], r["index"], r["method"]): r for r in rows
            if r.get("dtype", "float32") == dtype and "score" in r and "index" in r}


def _said(row: dict) -> str:
    return row.get("output", "").strip()


def compare(bf16_rows: list[dict], f32_rows: list[dict]) -> list[dict]:
    """One summary per method over the (task, instance) pairs both dtypes ran."""
    a, b = _keyed(bf16_rows, "bf16"), _keyed(f32_rows, "float32")
    out = []
    for method in sorted({k[2] for k in a.keys() & b.keys()}):
        keys = sorted(k for k in a.keys() & b.keys() if k[2] == method)
        dll = [b[k]["answer_ll"] - a[k]["answer_ll"] for k in keys
               if a[k].get("answer_ll") is not None and b[k].get("answer_ll") is not None]
        out.append({
            "method": method, "n": len(keys),
            "right_bf16": sum(a[k]["score"] for k in keys), "right_float32": sum(b[k]["score"] for k in keys),
            "same_output": sum(_said(a[k]) == _said(b[k]) for k in keys),
            "flips": [f"{k[0]}#{k[1]}: {a[k]['score']:g} -> {b[k]['score']:g}" for k in keys
                      if a[k]["score"] != b[k]["score"]],
            "dll_mean": statistics.mean(dll) if dll else None,
            "dll_min": min(dll) if dll else None, "dll_max": max(dll) if dll else None,
        })
    return out


def render(summary: list[dict]) -> str:
    lines = ["| method | n | right, bf16 weights | right, float32 | identical outputs | flips | "
             "answer LL float32 − bf16 (mean, min, max) |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        ll = ("–" if s["dll_mean"] is None
              else f"{s['dll_mean']:+.3f} ({s['dll_min']:+.3f}, {s['dll_max']:+.3f})")
        lines.append(f"| `{s['method']}` | {s['n']} | {s['right_bf16']:g} | {s['right_float32']:g} | "
                     f"{s['same_output']} | {', '.join(s['flips']) or 'none'} | {ll} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bf16_dir", type=Path, help="a bench --out run with --dtype bf16")
    p.add_argument("float32_dir", type=Path, help="the same model and tasks with --dtype float32")
    p.add_argument("--out", type=Path, help="also write dtype.md here")
    args = p.parse_args(argv)
    summary = compare(read_jsonl(args.bf16_dir / "results.jsonl"),
                      read_jsonl(args.float32_dir / "results.jsonl"))
    if not summary:
        print("no (task, instance, method) ran under both dtypes in these directories", file=sys.stderr)
        return 2
    text = render(summary)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        title = f"# bf16 weights against float32 ({args.bf16_dir} vs {args.float32_dir})"
        (args.out / "dtype.md").write_text(f"{title}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
