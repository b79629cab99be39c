"""Report section: decode time per token as a multiple of the stock `dynamic` row's, of the fastest
stock row's (`dynamic` or `static`, per cell) and of `bf16`'s, each on exactly the instances both
ran (paired), from the benchmark's own rows."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

from kvstrata_lab.bench.config import STOCK
from kvstrata_lab.bench.results import RANKED_TASKS, ReportInput

REFS = ("dynamic", "stock", "bf16")  # "stock": per cell, the faster of the stock rows it ran


def run_of(row: dict) -> str:
    """Which run of its cell wrote `row`: the `run` id; for rows written before run ids, the prefill
    time, which every method of one run of a cell shares (they decode from one prefill)."""
    return row.get("run") or f"prefill {row['prefill_s']!r}"


def ratios(rows: list[dict]) -> dict:
    """{(model, length): {method: {"n": cells, "s": mean s/token, ref: ratio or None, "n " + ref:
    cells paired}}}, over the retrieval and text-family rows. A ratio pairs rows of the same run of a
    cell only: times from different runs (another day, another load on the machine) are never divided."""
    cells = defaultdict(dict)  # (model, length) -> {(task, index, run): {method: s/token}}
    for r in rows:
        if r.get("error") or r["task"] not in RANKED_TASKS or not r.get("decode_s_per_token"):
            continue
        cells[(r["model"], r["length"])].setdefault((r["task"], r["index"], run_of(r)), {})[r["method"]] = r[
            "decode_s_per_token"
        ]
    out = {}
    for key, by_cell in sorted(cells.items()):
        methods = list(dict.fromkeys(m for c in by_cell.values() for m in c))
        for c in by_cell.values():
            stock = [c[s] for s in STOCK if s in c]
            if stock:
                c["stock"] = min(stock)
        table = {}
        for m in methods:  # the "stock" pseudo-row is a reference only, never a row of its own
            mine = [c for c in by_cell.values() if m in c]
            entry = {"n": len(mine), "s": mean(c[m] for c in mine)}
            for ref in REFS:
                both = [c for c in mine if ref in c]
                entry[ref] = mean(c[m] for c in both) / mean(c[ref] for c in both) if both else None
                entry[f"n {ref}"] = len(both)
            table[m] = entry
        out[key] = table
    return out


def report_section(given: ReportInput) -> str:
    table = ratios(given.rows)
    if not any("dynamic" in t for t in table.values()):
        return ""
    lines = [
        "## Decode speed\n",
        "Decode seconds per token on the retrieval and text-family tasks, as a multiple of the stock "
        "`dynamic` row "
        "(transformers' DynamicCache, the model's own attention, no kvstrata code), of the fastest stock "
        "row the cell ran (`dynamic` or `static`: transformers' StaticCache, preallocated) and of our "
        "`bf16`, each "
        "on the cells both ran in the same run of the cell (one prefill; rows from other runs are never "
        "paired). `n` = cells (task instances); the count after a ratio = the cells it pairs; `–` = no "
        "same-run reference (kvpress presses each prefill apart, in their own process).\n",
    ]
    for (model, length), t in table.items():
        if "dynamic" not in t:
            continue
        lines += [
            f"### {model} @ {length}\n",
            "| method | n | s/token | × dynamic | × fastest stock | × bf16 |",
            "|---|---|---|---|---|---|",
        ]
        for m, e in t.items():
            f = lambda ref: "–" if e[ref] is None else f"{e[ref]:.2f} ({e['n ' + ref]})"  # noqa: E731
            lines.append(f"| `{m}` | {e['n']} | {e['s']:.3f} | {f('dynamic')} | {f('stock')} | {f('bf16')} |")
        lines.append("")
    return "\n".join(lines)


HEADLINE = (
    "dynamic", "static", "bf16", "fp8", "int4:r=32", "nvfp4", "mxfp4", "int2:r=32", "streaming:keep=0.28",
    "snapkv:keep=0.28", "qcache:quanto:int4", "qcache:hqq:int4", "llamacpp:f16", "llamacpp:q8_0",
    "llamacpp:q4_0",
)


def headline(
    summary: dict, rows: list[dict], keys: list[tuple[str, int]], best: tuple[str, ...] = (),
    decode_rows: list[dict] | None = None,
) -> str:
    """README's table: for each (model, length) in `keys`, per method (the stock ones, then `best`:
    those on a frontier) ×smaller than bf16 / retrieval on the usable tasks / decode s per token as a
    multiple of the fastest stock row's (paired, same run of a cell), timed on `decode_rows` when
    given (a speed run on the same tasks that ran `static` beside `dynamic`), else on `rows`."""
    table = ratios(rows if decode_rows is None else decode_rows)
    keys = [k for k in keys if k in summary]
    head = ["method"] + [f"{m} {L // 1024}k: ×smaller / retrieval / decode ×fastest stock" for m, L in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in dict.fromkeys(HEADLINE + best):
        if not any(m in summary[k]["methods"] for k in keys):
            continue
        cells = [f"`{m}`"]
        for k in keys:
            r = summary[k]["methods"].get(m)
            speed = table.get(k, {}).get(m, {}).get("stock")
            cells.append(
                "–"
                if r is None
                else " / ".join(
                    "–" if v is None else f"{v:.2f}" for v in (r["compression"], r["retrieval"], speed)
                )
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
