"""The report's peers section: who is ahead per task at matched bytes, and how peers failed."""

from __future__ import annotations

from collections import defaultdict

from kvstrata_lab.bench.paired import paired_delta
from kvstrata_lab.bench.peers import own_reference
from kvstrata_lab.bench.results import ReportInput
from kvstrata_lab.bench.tasks import FIDELITY

#: bytes per token as a share of bf16's, bucketed so that rows of similar cost meet
TIERS = (("≈ 1/2 of bf16", 0.42, 0.70), ("≈ 1/3 of bf16", 0.30, 0.42), ("≈ 1/4 of bf16", 0.22, 0.30),
         ("≤ 1/5 of bf16", 0.0, 0.22))


def tier(share: float) -> str | None:
    for label, lo, hi in TIERS:
        if lo <= share < hi:
            return label
    return None


def head_to_head(summary: dict, rows: list[dict]) -> str:
    """Per model/length, bytes tier and task: the best kvstrata method against the best peer, both
    scored on the instances every peer of the tier ran, and their paired difference with its 95 %
    bootstrap interval; 'ahead' only where the whole interval says so."""
    lines = []
    scores = _scores(rows)
    for (model, length), s in summary.items():
        methods = s["methods"]
        if not any(r["family"] == "peer" for r in methods.values()):
            continue
        ref = methods.get("bf16")
        full = ref["kv_bytes_per_token"] if ref else max(r["kv_bytes_per_token"] for r in methods.values())
        # tasks the bf16 reference fails are beyond the model: not used to rank, here either
        tasks = [t for t in s["tasks"] if t in FIDELITY or s["usable"].get(t)]
        body = []
        for label, _, _ in TIERS:
            ours, theirs = (_in_tier(methods, full, label, peer) for peer in (False, True))
            if not ours or not theirs:
                continue
            for t in tasks:
                cell = (model, length, t)
                same = _common(scores, cell, theirs)
                a, b = _best(scores, cell, ours, same), _best(scores, cell, theirs, same)
                if a is None or b is None:
                    continue
                d = paired_delta(*({(t, i): scores[(*cell, m)][i] for i in same} for m in (a[0], b[0])))
                verdict = {"ahead": "kvstrata", "behind": "peer"}.get(d.verdict(), "not distinguishable")
                body.append(f"| {label} | {t}{' (top-1)' if t in FIDELITY else ''} | `{a[0]}` {a[1]:.2f} | "
                            f"`{b[0]}` {b[1]:.2f} | {d.text()} | **{verdict}** |")
        lines += [f"#### {model}, {length} tokens\n"]
        lines += (
            ["| bytes/token | task | best kvstrata | best peer | Δ kvstrata − peer, 95 % | ahead |",
             "|---|---|---|---|---|---|", *body]
            if body
            else ["No bytes tier holds both a kvstrata method and a peer here."]
        )
        lines.append("")
    return "\n".join(lines)


def _in_tier(methods: dict, full: float, label: str, peer: bool) -> list[str]:
    """Peers (or, with `peer` False, kvstrata methods other than the references) in bytes tier `label`."""
    return [m for m, r in methods.items() if (r["family"] == "peer") == peer and r["family"] != "reference"
            and tier(r["kv_bytes_per_token"] / full) == label]


def _scores(rows: list[dict]) -> dict[tuple, dict[int, float]]:
    """{(model, length, task, method): {instance index: score}} over the scored rows, built once."""
    out: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.get("score") is not None:
            out[(r["model"], r["length"], r["task"], r["method"])][r["index"]] = r["score"]
    return out


def _common(scores, cell: tuple, methods) -> set[int]:
    """Instance indices every one of `methods` ran (and scored) for this (model, length, task)."""
    sets = [set(scores.get((*cell, m), {})) for m in methods]
    return set.intersection(*sets) if sets else set()


def _best(scores, cell: tuple, methods, indices: set[int]) -> tuple[str, float] | None:
    """The method with the highest mean score on `indices` among those that ran all of them."""
    scored = [
        (m, sum(got[i] for i in indices) / len(indices))
        for m in methods
        if indices and indices <= set(got := scores.get((*cell, m), {}))
    ]
    return max(scored, key=lambda x: x[1]) if scored else None


def failures(rows: list[dict]) -> str:
    """One line per (model, peer, error): how a peer failed, on which tasks and lengths."""
    seen: dict[tuple, set] = defaultdict(set)
    for r in rows:
        if r.get("error"):
            seen[(r["model"], r["method"], r.get("peer", ""), r["error"])].add(f"{r['task']}@{r['length']}")
    if not seen:
        return ""
    lines = ["| model | peer spec | peer | cells | how it failed |", "|---|---|---|---|---|"]
    for (model, method, peer, error), cells in sorted(seen.items()):
        lines.append(
            f"| {model} | `{method}` | {peer} | {len(cells)} "
            f"({', '.join(sorted(cells)[:4])}{', …' if len(cells) > 4 else ''}) | {error.replace('|', '/')} "
            "|"
        )
    return "\n".join(lines) + "\n"


def masked(rows: list[dict]) -> str:
    """Head-wise presses mask entries at attention time but keep them: what they hold vs attend."""
    share = defaultdict(list)
    for r in rows:
        if not r.get("error") and r.get("kv_entries_masked"):
            share[r["method"]].append(r["kv_entries_masked"] / r["kv_entries_held"])
    return "".join(
        f"`{m}` masks {sum(v) / len(v):.0%} of the entries it holds at attention time and keeps them in "
        "memory, so it is listed at the bytes it holds.\n"
        for m, v in sorted(share.items())
    )


def report_section(given: ReportInput) -> str:
    """The whole peers section of report.md ('' when no peer ran)."""
    summary, rows = given.summary, given.rows
    peer_rows = [r for r in rows if r.get("family") == "peer"]
    if not peer_rows:
        return ""
    versions = sorted({r["peer"] for r in peer_rows if r.get("peer")})
    out = [
        "## Peers, same instances\n",
        "Rows of family `peer` are other projects' implementations run on the exact task instances above "
        "(same seeds, tokenizer and context ids), with bytes counted from the tensors their caches hold "
        "(float tensors at 16 bits, as our `bf16` reference stores them; llama.cpp's at its KV types' block "
        "layout). Versions: "
        f"{'; '.join(versions)}.\n",
        masked(peer_rows),
        "Who is ahead per task at matched bytes: the best method of each side inside a bytes tier, both "
        "scored on the instances every peer of the tier ran, and their paired difference in points with "
        "its 95 % bootstrap interval over those instances. A side is ahead only when the whole interval "
        "says so. Each side's best is picked on these same instances, which favours the side with more rows "
        "in the tier (usually ours).\n",
        head_to_head(summary, rows),
        own_reference.report_section(summary, rows),
    ]
    fails = failures(peer_rows)
    if fails:
        out += ["### How peers failed\n", fails]
    return "\n".join(out)
