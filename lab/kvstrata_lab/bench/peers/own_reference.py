"""Each system against its own uncompressed row: llama.cpp's KV types against `llamacpp:f16`, ours
against `bf16`, on the same instances (paired), retrieval and decode time alike.

Absolute scores across systems differ for reasons that are not the KV cache (llama.cpp runs the
GGUF's quantized weights, ours the dequantized ones), so what a compressed cache costs is each
system's own drop; our best at llama.cpp `q4_0`'s bytes or fewer is set beside `q4_0`'s drop."""

from __future__ import annotations

from collections import defaultdict

from kvstrata_lab.bench.paired import paired_delta
from kvstrata_lab.bench.results import fmt
from kvstrata_lab.bench.speed import run_of
from kvstrata_lab.bench.tasks import FIDELITY

#: a peer project's uncompressed row (ours: bf16)
REFERENCE = {"llamacpp": "llamacpp:f16"}
MATCH = "llamacpp:q4_0"  # our rows at its bytes or fewer are set beside it


def _by_method(rows: list[dict], model: str, length: int, tasks: set[str]) -> dict:
    """{method: ({(task, index): score}, {(task, index): (run, decode s/token)})} over the scored
    retrieval rows."""
    out: dict = defaultdict(lambda: ({}, {}))
    for r in rows:
        here = r["model"] == model and r["length"] == length and r["task"] in tasks
        if here and r.get("score") is not None:
            scores, decode = out[r["method"]]
            scores[(r["task"], r["index"])] = r["score"]
            if r.get("decode_s_per_token"):
                decode[(r["task"], r["index"])] = (run_of(r), r["decode_s_per_token"])
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _gain(a: dict, b: dict) -> float:
    d = paired_delta(a, b)
    return d.mean if d else float("-inf")


def _line(system: str, m: str, ref: str, methods: dict, got: dict) -> str:
    (a, da), (b, db) = got[m], got[ref]
    d = paired_delta(a, b)
    timed = [k for k in da.keys() & db.keys() if da[k][0] == db[k][0]]  # timed in the same run of a cell
    speed = _mean([da[k][1] for k in timed]) / _mean([db[k][1] for k in timed]) if timed else None
    r = methods[m]
    return (f"| {system} | `{m}` | {fmt(r['kv_bytes_per_token'], '{:,.0f}')} | {fmt(r['compression'])} | "
            f"{fmt(_mean(list(a.values())))} | {d.text() if d else '–'} | {fmt(speed)} |")


def table(summary: dict, rows: list[dict]) -> str:
    """Per (model, length) holding llama.cpp rows: every llama.cpp type against `llamacpp:f16`, and
    ours at `q4_0`'s bytes or fewer against `bf16` (the best first)."""
    out = []
    for (model, length), s in summary.items():
        methods = s["methods"]
        peer_ref = REFERENCE["llamacpp"]
        if peer_ref not in methods or "bf16" not in methods:
            continue
        tasks = {t for t in s["tasks"] if t not in FIDELITY and s["usable"].get(t)}
        got = _by_method(rows, model, length, tasks)
        keys = set(got[peer_ref][0]) if peer_ref in got else set()
        # every row scored on the instances llama.cpp ran, and only rows that ran all of them
        got = {m: tuple({k: v for k, v in d.items() if k in keys} for d in pair) for m, pair in got.items()
               if keys and keys <= set(pair[0])}
        lines = [_line("llama.cpp", m, peer_ref, methods, got) for m in methods
                 if m.startswith("llamacpp:") and m != peer_ref and m in got]
        cap = methods[MATCH]["kv_bytes_per_token"] if MATCH in methods else None
        ours = [m for m, r in methods.items() if r["family"] not in ("peer", "reference") and m in got
                and cap is not None and r["kv_bytes_per_token"] <= cap * 1.005]
        ranked = sorted(ours, key=lambda m: -_gain(got[m][0], got["bf16"][0]))
        shown = ranked[:5] + [m for m in ("nvfp4",) if m in ranked[5:]]  # NVFP4, the design's codec, always
        lines += [_line("kvstrata", m, "bf16", methods, got) for m in shown]
        if not tasks or not lines:
            out += [f"#### {model}, {length} tokens\n", "No retrieval task here that the `bf16` reference is "
                    "usable on, or no row to set beside its reference.", ""]
            continue
        out += [f"#### {model}, {length} tokens\n",
                "| system | row | B/token | × smaller | retrieval here | Δ vs its own uncompressed, 95 % | "
                "decode ÷ its own uncompressed |", "|---|---|---|---|---|---|---|", *lines, ""]
    return "\n".join(out)


def report_section(summary: dict, rows: list[dict]) -> str:
    body = table(summary, rows)
    if not body:
        return ""
    return "\n".join([
        "### Each system against its own uncompressed row\n",
        "llama.cpp's KV cache types against `llamacpp:f16` (its own uncompressed cache, on the GGUF's "
        "quantized weights), and our five best rows at llama.cpp `q4_0`'s bytes per token or fewer "
        "against our `bf16` (dequantized weights), all on the instances llama.cpp ran (rows that did not "
        "run every one of them are left out): retrieval Δ in points (paired, 95 % bootstrap interval) "
        "and decode seconds per token as a multiple of the same system's uncompressed row on the same "
        "instances, timed in the same run of each cell (`–` where no cell timed both).\n",
        body,
    ])
