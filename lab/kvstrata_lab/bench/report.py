"""`kvstrata report DIR`: Markdown tables, PNG plots and one self-contained HTML page from results.jsonl."""

from __future__ import annotations

import base64
import html
import os
import re
from pathlib import Path

from kvstrata_lab.bench import (
    depth_ablation,
    frontier,
    kernels,
    memory,
    reason_report,
    scaling,
    sparse_frontier,
    speed,
    transfer,
    v41_prefill,
)
from kvstrata_lab.bench.labels import place_labels
from kvstrata_lab.bench.peers import compare
from kvstrata_lab.bench.results import (
    FAMILY_COLOURS,
    USABLE,
    ReportInput,
    fmt,
    load_meta,
    load_note,
    load_results,
    save_meta,
    summarise,
)

# The report's sections after the main tables, in order: each takes a ReportInput and returns Markdown
# ('' when its experiment has not run into this directory).
SECTIONS = (
    transfer.report_section, reason_report.report_section, frontier.report_section, speed.report_section,
    kernels.report_section,
    memory.report_section, scaling.report_section,
    compare.report_section,
    sparse_frontier.report_section, depth_ablation.report_section, v41_prefill.report_section,
)


def _fed_note(fed: dict[str, tuple[int, int]]) -> str:
    span = lambda lo, hi: f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"  # noqa: E731
    parts = []
    if "questions" in fed:
        parts.append(f"{span(*fed['questions'])} tokens before the question (question tasks)")
    if "fidelity" in fed:
        parts.append(f"{span(*fed['fidelity'])} tokens before the continuation (fidelity)")
    return f"Contexts fed: {'; '.join(parts)}.\n" if parts else ""


def markdown(summary: dict) -> str:
    lines = []
    for (model, length), s in summary.items():
        tasks = s["tasks"]
        lines.append(f"### {model}, {length} tokens ({s['n']} instances per task)\n")
        lines.append(_fed_note(s["fed"]))
        unusable = [t for t, ok in s["usable"].items() if not ok]
        if unusable:
            lines.append(
                f"Tasks the uncompressed `bf16` reference scores below {USABLE:.0%} on (beyond this model; "
                f"shown, not used to rank): {', '.join(unusable)}.\n"
            )
        lines.append(
            "`n` = instances per task (the first n, a range when tasks differ; `bf16 (first n)` is the "
            "reference on those same instances). Failures (`fail: retr / reas`) count questions over the "
            f"tasks every method here ran: {', '.join(s['common'])}. `–` = not run.\n"
        )
        head = (
            ["method", "family", "n", "B/token", "× smaller", "retrieval"]
            + tasks
            + [
                "fail: retr / reas", "KL", "top-1", "Δppl", "B read/step", "prefill s", "decode s/tok",
                "peak RSS MB",
            ]
        )
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        order = sorted(s["methods"].items(), key=lambda kv: -kv[1]["kv_bytes_per_token"])
        for m, r in order:
            n = str(r["n"]) if r["n"] == r["n_max"] else f"{r['n']}–{r['n_max']}"
            cells = [
                f"`{m}`", r["family"], n, fmt(r["kv_bytes_per_token"], "{:,.0f}"), fmt(r["compression"]),
                fmt(r["retrieval"]),
            ]
            cells += [fmt(r["per_task"][t]) for t in tasks]
            cells += [
                f"{r['fail_retrieval']} / {r['fail_reasoning']}", fmt(r["kl"], "{:.4f}"), fmt(r["top1"]),
                fmt(r["ppl_change"], "{:+.2%}"), fmt(r["bytes_read_per_step"], "{:,.0f}"),
                fmt(r["prefill_s"]) + "†" * bool(r.get("busy")),
                fmt(r["decode_s_per_token"], "{:.3f}") + "†" * bool(r.get("busy")),
                fmt(r["peak_rss_mb"], "{:,.0f}"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def compact(summary: dict) -> str:
    """One row per method, per (model, length): compression vs bf16, bytes read per decode step as a
    share of bf16's, retrieval on usable tasks, fidelity top-1 (what the README shows)."""
    keys = list(summary)
    methods = list(dict.fromkeys(m for s in summary.values() for m in s["methods"]))
    head = ["method"] + [f"{m} {L // 1024}k: ×smaller / read / retrieval / top-1" for m, L in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        cells = [f"`{m}`"]
        for k in keys:
            r = summary[k]["methods"].get(m)
            ref = summary[k]["methods"].get("bf16")
            read = (
                r["bytes_read_per_step"] / ref["bytes_read_per_step"]
                if r and ref and r["bytes_read_per_step"] and ref["bytes_read_per_step"]
                else None
            )
            cells.append(
                "–"
                if r is None
                else f"{fmt(r['compression'])} / {fmt(read, '{:.0%}')} / {fmt(r['retrieval'])} / "
                f"{fmt(r['top1'])}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(summary: dict, out: Path) -> list[Path]:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    paths = []
    for (model, length), s in summary.items():
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
        labels = []
        for m, r in s["methods"].items():
            y = r["retrieval"] if r["retrieval"] is not None else r["top1"]
            if y is None:
                continue
            ax.scatter(r["kv_bytes_per_token"], y, color=FAMILY_COLOURS.get(r["family"], "tab:gray"), s=40)
            labels.append((r["kv_bytes_per_token"], y, m))
        ax.set_xscale("log")
        ax.set_xlabel("stored KV bytes per token (log)")
        ax.set_ylabel("retrieval score (usable tasks)")
        ax.set_title(f"{model} @ {length}: quality vs bytes")
        for fam, colour in FAMILY_COLOURS.items():
            if any(r["family"] == fam for r in s["methods"].values()):
                ax.scatter([], [], color=colour, label=fam)
        ax.legend(fontsize=8)
        names = list(s["methods"])
        retr = [s["methods"][m]["fail_retrieval"] for m in names]
        reas = [s["methods"][m]["fail_reasoning"] for m in names]
        bx.bar(names, retr, label="retrieval failures", color="tab:red")
        bx.bar(names, reas, bottom=retr, label="reasoning failures", color="tab:olive")
        bx.set_ylabel("failed questions")
        bx.set_title("failures, tagged")
        bx.tick_params(axis="x", rotation=60, labelsize=7)
        bx.legend(fontsize=8)
        fig.tight_layout()
        place_labels(ax, labels)  # after the layout: no two labels overlap
        p = out / f"plot_{model}_{length}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def write_report(out: Path, skip_bad: bool = False, decode_from: Path | None = None) -> Path:
    """Write report.md, plot_*.png and report.html into `out`; returns the Markdown path. Bad rows
    of results.jsonl are refused, or with `skip_bad` left out and their number stated. `decode_from`:
    a bench directory whose rows time the headline's decode column (recorded in meta.json, so a
    later `kvstrata report` of `out` writes the same headline)."""
    rows, skipped = load_results(out, skip_bad)
    if not rows:
        raise ValueError(f"{out}/results.jsonl has no rows")
    summary = summarise(rows)
    if decode_from is not None:
        record_decode_source(out, decode_from)
    stored = load_meta(out)
    meta = stored.get("runs", [{}])[-1]
    timed = out / stored["decode_from"] if stored.get("decode_from") else None
    decode_rows = load_results(timed, skip_bad)[0] if timed else None  # before anything is written
    note = _protocol_note(meta) + load_note(rows) + (
        f"\n**{skipped} malformed row(s) of results.jsonl were skipped** (`--skip-bad`).\n" if skipped else ""
    ) + (
        f"\nThe headline's decode column is timed by the rows of `{stored['decode_from']}` (a speed run on "
        "the same tasks with `static` beside `dynamic`).\n" if timed else ""
    )
    given = ReportInput(out, rows, summary, skip_bad)
    md = ["# kvstrata benchmark report\n", note, markdown(summary)] + [section(given) for section in SECTIONS]
    sections = "\n".join(md[2:])
    pngs = plots(summary, out)
    md += [f"![{p.stem}]({p.name})\n" for p in pngs]
    (out / "report.md").write_text("\n".join(md))
    (out / "summary.md").write_text(compact(summary))
    headline_keys = sorted(k for k, v in summary.items() if "dynamic" in v["methods"] and k[1] >= 4096)
    pts = frontier.points(given)
    best = tuple(p["method"] for k in headline_keys for p in pts.get(k, []) if p["frontier"])
    headline = speed.headline(summary, rows, headline_keys, best, decode_rows) if headline_keys else None
    (out / "headline.md").write_text(headline or no_headline(summary))
    (out / "report.html").write_text(_html("\n".join(md[:2]), sections, pngs, out))
    return out / "report.md"


def no_headline(summary: dict) -> str:
    """headline.md's one line when no cell qualifies (a quick or partial run), instead of an empty table."""
    cells = ", ".join(f"{m} {L:,} ({'with' if 'dynamic' in s['methods'] else 'without'} `dynamic`)"
                      for (m, L), s in summary.items())
    return ("No headline: it shows cells of at least 4,096 tokens whose run has `dynamic` beside the rest; "
            f"here: {cells}. Every row is in summary.md and report.md.\n")


def record_decode_source(out: Path, decode_from: Path) -> None:
    """Store in `out`/meta.json which bench directory times the headline's decode column, as a path
    relative to `out` (the two directories move together)."""
    if not (decode_from / "results.jsonl").exists():
        raise FileNotFoundError(
            f"--decode-from {decode_from}: holds no benchmark results (results.jsonl is missing)"
        )
    stored = load_meta(out)
    stored["decode_from"] = os.path.relpath(decode_from.resolve(), out.resolve())
    save_meta(out, stored)


def _protocol_note(meta: dict) -> str:
    return (
        "Context first, question after: the context is prefilled once in full precision, each method "
        "builds its cache from it (keep policy, then encoding), the question is fed and the answer decoded "
        "greedily reading only that cache. Retrieval = mean string-match score over the usable RULER-style "
        "tasks; a failed chain question is tagged `reasoning` when every single-hop probe of its links "
        "passed, else `retrieval`. Fidelity (KL, top-1, Δppl) is measured on natural-text continuations "
        "against the uncompressed cache. B read/step = bytes a dense decode step reads (every entry held). "
        f"Times are wall-clock on this machine (torch {meta.get('torch', '?')}, {meta.get('threads', '?')} "
        "threads); compare them within one run.\n"
    )


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" style="max-width:100%">'


def _html(intro: str, table_md: str, pngs: list[Path], base: Path) -> str:
    """One self-contained page: tables as HTML, every plot (main and sections') embedded."""
    body = [
        f"<p>{html.escape(line)}</p>"
        for line in intro.splitlines()
        if line.strip() and not line.startswith("#")
    ]
    rows_html = []
    lines = table_md.splitlines()
    for i, line in enumerate(lines):
        image = re.fullmatch(r"!\[[^\]]*\]\(([^)]+)\)", line.strip())
        if image and (base / image[1]).is_file():
            rows_html.append(_img(base / image[1]))
        elif line.startswith("#"):
            rows_html.append(f"<h3>{html.escape(line.lstrip('#').strip())}</h3>")
        elif line.startswith("|") and "---" not in line:
            header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
            tag = "th" if header else "td"
            cells = "".join(
                f"<{tag}>{html.escape(c.strip().strip('`'))}</{tag}>" for c in line.strip("|").split("|")
            )
            rows_html.append(f"<tr>{cells}</tr>")
        elif line.strip():
            rows_html.append(f"<p>{html.escape(line)}</p>")
    out, in_table = [], False
    for item in rows_html:  # consecutive rows form one table
        is_row = item.startswith("<tr>")
        if is_row != in_table:
            out.append("<table>" if is_row else "</table>")
            in_table = is_row
        out.append(item)
    table = "\n".join(out + (["</table>"] if in_table else []))
    imgs = "".join(_img(p) for p in pngs)
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:3px 6px}")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvstrata "
        f"report</title><style>{style}</style></head><body><h1>kvstrata benchmark "
        f"report</h1>{''.join(body)}{table}{imgs}</body></html>"
    )
