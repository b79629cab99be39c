"""`serve-bench` numbers: per-phase summaries, the store-on / store-off ratios, the issue's targets,
and the files in `docs/results/serve/` (JSON, a Markdown table, a plot)."""

from __future__ import annotations

import json
import math
from pathlib import Path

KINDS = ("miss", "replay", "hit")


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no samples)."""
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else None


def _dist(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}


def _ratio(a, b):
    return a / b if a is not None and b else None


def phase_summary(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if not r["error"]]
    later = [r for r in ok if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok), "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "completion_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall_s if wall_s else None,
        "ttft_s": {k: _dist([r["ttft_s"] for r in ok if r["kind"] == k]) for k in KINDS},
        "ttft_first_turns_s": _dist([r["ttft_s"] for r in ok if r["turn"] == 1]),
        "ttft_later_turns_s": _dist([r["ttft_s"] for r in later]),
        "hit_rate_later_turns": sum(r["kind"] == "hit" for r in later) / len(later) if later else None,
        "reuse_rate_later_turns": sum(r["kind"] != "miss" for r in later) / len(later) if later else None,
        "cached_token_share": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
        "overhead_ms_p50": _pct([(r["ttft_s"] - r["server_ttft_s"]) * 1e3 for r in ok
                                 if r["server_ttft_s"] is not None], 0.5),
    }


def probe_summary(probe: dict) -> dict:
    rows = [r for r in probe["rows"] if not r["error"]]
    ttft = lambda phase: [r["ttft_s"] for r in rows if r["phase"] == phase]  # noqa: E731
    cold, warm, replay = _pct(ttft("cold"), 0.5), _pct(ttft("warm"), 0.5), _pct(ttft("replay"), 0.5)
    return {"errors": len(probe["rows"]) - len(rows), "kinds": [r["kind"] for r in rows],
            "prompt_tokens": rows[0]["prompt_tokens"] if rows else None,
            "cold_ttft_s": cold, "warm_ttft_s": warm, "replay_ttft_s": replay,
            "warm_vs_cold": _ratio(warm, cold), "replay_vs_cold": _ratio(replay, cold),
            "overhead_ms_p50": _pct([(r["ttft_s"] - r["server_ttft_s"]) * 1e3 for r in rows], 0.5),
            "overhead_ms_max": max(((r["ttft_s"] - r["server_ttft_s"]) * 1e3 for r in rows), default=None)}


def summarize(result: dict) -> dict:
    out: dict = {"model": result["config"]["model"], "method": result["config"]["method"],
                 "endpoint": result["endpoint"]}
    if "probe" in result:
        out["probe"] = probe_summary(result["probe"])
    phases = {n: phase_summary(p["records"], p["wall_s"]) for n, p in result["phases"].items()}
    out["phases"] = phases
    on, off = phases["store"], phases["no_store"]
    out["ratios"] = {
        "ttft_p99_later_turns": _ratio(on["ttft_later_turns_s"]["p99"], off["ttft_later_turns_s"]["p99"]),
        "ttft_p50_later_turns": _ratio(on["ttft_later_turns_s"]["p50"], off["ttft_later_turns_s"]["p50"]),
        "requests_per_s": _ratio(on["requests_per_s"], off["requests_per_s"]),
    }
    if "check" in result:
        out["check"] = {k: result["check"][k] for k in ("checked", "differ")}
    if "store_bytes" in result:
        out["store_bytes"] = result["store_bytes"]
    if "peer" in phases:
        out["peer"] = peer_summary(result, on, phases["peer"])
    elif "peer" in result:
        out["peer"] = {k: result["peer"][k] for k in ("name", "describe", "error")}
    p = out.get("probe", {})
    out["targets"] = {
        "probe warm TTFT <= 5% of cold": _le(p.get("warm_vs_cold"), 0.05),
        "probe replay TTFT <= 15% of cold": _le(p.get("replay_vs_cold"), 0.15),
        "HTTP + queueing overhead <= 20 ms at 1 client (p50)": _le(p.get("overhead_ms_p50"), 20.0),
        "0 errors": on["errors"] == 0 and off["errors"] == 0,
        "0 answers differ from uncached greedy (sample)": out.get("check", {}).get("differ") == 0,
        "later-turn TTFT p99 <= 20% of store-off": _le(out["ratios"]["ttft_p99_later_turns"], 0.20),
    }
    if "peer" in out and "error" not in out["peer"]:
        peer = out["peer"]
        out["targets"][f"later-turn TTFT p50 <= {peer['name']}'s"] = _le(peer["ttft_p50_later_turns"], 1.0)
        if peer.get("bytes_per_token_vs_ours") is not None:
            out["targets"][f"bytes kept per cached token <= 1/3 of {peer['name']}'s slot files"] = _le(
                1 / peer["bytes_per_token_vs_ours"], 1 / 3)
    return out


def peer_summary(result: dict, ours: dict, peer: dict) -> dict:
    """The peer's phase beside our store-on phase: ratios ours ÷ peer (below 1: ours is faster / smaller)."""
    theirs = result["peer"]["persist"].get("bytes_per_token")
    mine = (result.get("store_bytes") or {}).get("bytes_per_token")
    return {
        "name": result["peer"]["name"], "describe": result["peer"]["describe"],
        "persist": result["peer"]["persist"],
        "ttft_p50_later_turns": _ratio(ours["ttft_later_turns_s"]["p50"], peer["ttft_later_turns_s"]["p50"]),
        "ttft_p99_later_turns": _ratio(ours["ttft_later_turns_s"]["p99"], peer["ttft_later_turns_s"]["p99"]),
        "requests_per_s": _ratio(ours["requests_per_s"], peer["requests_per_s"]),
        "bytes_per_token_vs_ours": _ratio(theirs, mine),
    }


def _le(x, bound):
    return None if x is None else x <= bound


def _fmt(x, unit: str = "", scale: float = 1.0) -> str:
    return "–" if x is None else f"{x * scale:.3g}{unit}"


def markdown(s: dict) -> str:
    lines = [f"`kvstrata serve-bench` on {s['model']} ({s['method']}, /v1/{s['endpoint']}):", ""]
    if "probe" in s:
        p = s["probe"]
        lines += [f"Probe, 1 client, {p['prompt_tokens']}-token prompt: cold {_fmt(p['cold_ttft_s'], ' s')}, "
                  f"warm {_fmt(p['warm_ttft_s'], ' s')} ({_fmt(p['warm_vs_cold'], ' %', 100)} of cold), "
                  f"replay {_fmt(p['replay_ttft_s'], ' s')} ({_fmt(p['replay_vs_cold'], ' %', 100)}); HTTP "
                  f"+ queueing overhead p50 {_fmt(p['overhead_ms_p50'], ' ms')}, max "
                  f"{_fmt(p['overhead_ms_max'], ' ms')}.", ""]
    lines += ["| phase | requests | errors | req/s | tok/s | TTFT p50 / p99 miss | hit | replay | later "
              "turns | reuse (hit / any) | cached tokens |", "| --- " * 11 + "|"]
    for name, ph in s["phases"].items():
        t = ph["ttft_s"]
        cell = lambda d: f"{_fmt(d['p50'], ' s')} / {_fmt(d['p99'], ' s')} (n={d['n']})"  # noqa: E731
        lines.append(f"| {name.replace('_', '-')} | {ph['requests']} | {ph['errors']} | "
                     f"{_fmt(ph['requests_per_s'])} | {_fmt(ph['completion_tokens_per_s'])} | "
                     f"{cell(t['miss'])} | {cell(t['hit'])} | {cell(t['replay'])} | "
                     f"{cell(ph['ttft_later_turns_s'])} | {_fmt(ph['hit_rate_later_turns'], ' %', 100)} / "
                     f"{_fmt(ph['reuse_rate_later_turns'], ' %', 100)} | "
                     f"{_fmt(ph['cached_token_share'], ' %', 100)} |")
    r = s["ratios"]
    lines += ["", f"Later-turn TTFT, store on / off: p50 {_fmt(r['ttft_p50_later_turns'], ' %', 100)}, "
              f"p99 {_fmt(r['ttft_p99_later_turns'], ' %', 100)}; throughput ×{_fmt(r['requests_per_s'])}."]
    if "check" in s:
        lines.append(f"Answers re-asked of the store-off server: {s['check']['checked']} checked, "
                     f"{s['check']['differ']} differ.")
    if "store_bytes" in s:
        b = s["store_bytes"]
        lines.append(f"The store's records on disk: {b['records']} records, {_fmt(b['bytes_per_token'])} B "
                     "per token they hold.")
    if "peer" in s and "error" in s["peer"]:
        lines.append(f"Peer `{s['peer']['name']}` ({s['peer']['describe']}) could not serve this model: "
                     f"{s['peer']['error']}")
    elif "peer" in s:
        p = s["peer"]
        lines.append(f"Peer `{p['name']}` ({p['describe']}), ours (store on) ÷ the peer's: later-turn TTFT "
                     f"p50 ×{_fmt(p['ttft_p50_later_turns'])}, p99 ×{_fmt(p['ttft_p99_later_turns'])}; "
                     f"throughput ×{_fmt(p['requests_per_s'])}.")
        if p["persist"].get("bytes_per_token"):
            lines.append(f"Its slot files: {p['persist']['tokens']} tokens in {p['persist']['bytes']:,} B, "
                         f"{_fmt(p['persist']['bytes_per_token'])} B per token "
                         f"({_fmt(p['bytes_per_token_vs_ours'])}× our records').")
    lines += ["", "| target | met |", "| --- | --- |"]
    lines += [f"| {k} | {'–' if v is None else 'yes' if v else '**no**'} |" for k, v in s["targets"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)
    from matplotlib.ticker import MaxNLocator  # optional dependency (the bench extra)

    fig, (by_turn, by_kind) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"store": "store on", "no_store": "store off", "peer": result.get("peer", {}).get("name")}
    for name, style in (("store", "o-"), ("no_store", "s--"), ("peer", "^:")):
        if name not in result["phases"]:
            continue
        recs = [r for r in result["phases"][name]["records"] if not r["error"]]
        turns = sorted({r["turn"] for r in recs})
        by_turn.plot(turns, [_pct([r["ttft_s"] for r in recs if r["turn"] == t], 0.5) for t in turns], style,
                     label=f"{labels[name]} (median)")
    by_turn.set(yscale="log", xlabel="turn", ylabel="TTFT (s), client side", title="TTFT per turn")
    by_turn.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_turn.legend()
    s = result["summary"]["phases"]
    bars = [(f"{k} (on)", s["store"]["ttft_s"][k])
             for k in KINDS] + [("miss (off)", s["no_store"]["ttft_s"]["miss"])]
    bars = [(label, d) for label, d in bars if d["n"]]
    xs = range(len(bars))
    by_kind.bar([x - 0.2 for x in xs], [d["p50"] for _, d in bars], 0.4, label="p50")
    by_kind.bar([x + 0.2 for x in xs], [d["p99"] for _, d in bars], 0.4, label="p99")
    by_kind.set_xticks(list(xs), [label for label, _ in bars])
    by_kind.set(yscale="log", ylabel="TTFT (s)", title="TTFT by store outcome")
    by_kind.legend()
    fig.suptitle(f"serve-bench: {s['store']['requests']} requests per phase, {result['config']['clients']} "
                 f"clients, {result['config']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(result, indent=1))
    (out / "serve_bench.md").write_text(markdown(result["summary"]))
    plot(result, out / "serve_bench.png")
