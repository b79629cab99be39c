"""Bytes a method stores, per layer and per token, for any HF model config or the V4.1 presets.

For HF models the numbers come from the cache itself: a `CompressedCache` is filled with a
zero context of the requested length through `load_prefill` (the path the benchmark uses) and
its held bytes are read back, so accounting and allocation cannot drift apart.
"""

from __future__ import annotations

import torch

from kvstrata.hf.cache import CompressedCache, head_dim, layer_classes
from kvstrata.hf.run import bf16_bytes_per_token
from kvstrata.methods import parse_method, render_recipe


def account_hf(config, method: str, tokens: int, dtype: torch.dtype = torch.float32) -> dict:
    """Per-layer stored bytes after a `tokens`-long context prefill with `method`."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    text = config.get_text_config(decoder=True)
    heads = text.num_key_value_heads
    dim = head_dim(text)
    spec = parse_method(method)
    cache = CompressedCache(config, spec)
    layers, scores = [], []
    for cls, window in layer_classes(config):
        held = tokens if cls == "full" else min(tokens, window - 1)
        zeros = torch.zeros(1, heads, held, dim, dtype=dtype)
        layers.append((zeros, zeros, tokens))
        scores.append(torch.ones(1, heads, held) if cls == "full" else None)
    cache.load_prefill(layers, scores)
    rows = []
    for i, ((cls, window), layer, n) in enumerate(
        zip(layer_classes(config), cache.layers, cache.nbytes()["layers"])
    ):
        rows.append(
            {
                "layer": i, "class": cls, "window": window, "recipe": render_recipe(layer.recipe),
                "held_tokens": layer.stored_tokens(), "bytes": n, "bytes_per_token": n / tokens,
            }
        )
    total = sum(r["bytes"] for r in rows)
    ref = bf16_bytes_per_token(config, tokens)
    return {
        "method": str(spec), "tokens": tokens, "layers": rows, "total_bytes": total,
        "bytes_per_token": total / tokens, "bf16_bytes_per_token": ref,
        "compression_vs_bf16": ref / (total / tokens),
    }


def format_v41(report: dict, plan) -> str:
    lines = [
        f"{'layer':>5} {'mode':<8} {'source':>6} {'m':>3} {'global B/tok':>13} {'index B/tok':>12} "
        f"{'SWA B/seq':>10}"
    ]
    for p in plan:
        lines.append(
            f"{p.layer:>5} {p.mode:<8} {'' if p.source is None else p.source:>6} {p.m:>3} "
            f"{p.global_bytes_per_token:>13,.1f} {p.index_bytes_per_token:>12,.1f} {p.swa_bytes:>10,}"
        )
    b = report["baseline"]
    lines += [
        "",
        f"main entry {report['main_entry_bytes']} B, index key {report['index_key_bytes']} B",
        f"global KV: {report['global_kv_bytes_per_token']:,.1f} B/token ({b['preset']}: "
        f"{b['global_kv_bytes_per_token']:,.1f}; ratio {report['global_ratio_to_baseline']:.3f} = "
        f"1/{1 / report['global_ratio_to_baseline']:.2f})",
        f"persistent: {report['persistent_bytes_per_token']:,.1f} B/token, SWA not persisted "
        f"({b['preset']}: {b['persistent_bytes_per_token']:,.1f}; ratio "
        f"{report['persistent_ratio_to_baseline']:.3f} = "
        f"1/{1 / report['persistent_ratio_to_baseline']:.2f})",
    ] + [f"note: {n}" for n in b["notes"]]
    return "\n".join(lines)


def format_hf(report: dict, model: str) -> str:
    lines = [
        f"{model} with {report['method']} after {report['tokens']} tokens",
        f"{'layer':>5} {'class':<8} {'recipe':<28} {'held':>7} {'bytes':>12} {'B/token':>9}",
    ]
    for r in report["layers"]:
        lines.append(
            f"{r['layer']:>5} {r['class']:<8} {r['recipe']:<28} {r['held_tokens']:>7} {r['bytes']:>12,} "
            f"{r['bytes_per_token']:>9,.1f}"
        )
    lines.append(
        f"total {report['total_bytes']:,} B = {report['bytes_per_token']:,.1f} B/token; bf16 "
        f"{report['bf16_bytes_per_token']:,.1f} B/token ({report['compression_vs_bf16']:.2f}x smaller)"
    )
    return "\n".join(lines)
