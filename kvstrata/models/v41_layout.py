"""The V4.1-Flash cache layout (and V4-Flash's, for the comparison), as data.

One config dataclass, named presets, and `cache_plan(cfg)`: per layer its mode (SWA / Full /
Reindex / Reuse for CSA2; CSA / HCA for V4), its source layer, compression m, and the bytes it
stores per token. Entry sizes are not typed in: they are measured by encoding one entry with
kvstrata's own codecs (`entry_bytes`), the code that stores the entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DeepseekV4Config

from kvstrata.codecs import get_codec


def entry_bytes(parts: tuple[tuple[str, int], ...]) -> int:
    """Bytes of one stored entry made of `(codec spec, channels)` parts, measured by encoding."""
    return sum(get_codec(spec).encode(torch.zeros(1, dim)).nbytes for spec, dim in parts)


@dataclass(frozen=True)
class V41Layout:
    name: str
    layers: int
    hidden: int
    window: int = 128
    latent_dim: int = 512  # one shared latent per entry, K = V (MQA)
    rope_dim: int = 64
    index_dim: int = 128
    index_heads: int = 32
    topk: int = 512
    #: per layer: "swa" | "full" | "reindex" | "reuse" (V4.1) or "csa" | "hca" (V4)
    modes: tuple[str, ...] = ()
    #: compression m per layer (0 for pure SWA)
    m: tuple[int, ...] = ()
    #: codec parts of one main entry / index key / SWA entry
    main_entry: tuple[tuple[str, int], ...] = (("nvfp4:tensor_scale=0", 512),)
    index_entry: tuple[tuple[str, int], ...] = (("mxfp4", 128),)
    swa_entry: tuple[tuple[str, int], ...] = (("fp8", 512),)
    #: pure-SWA layers hold a V row apart from the K = V row (a deviation some reference runs use)
    swa_values: bool = False
    #: V4 persisted each cached prefix's SWA window once per this many tokens (an assumption: see docs)
    swa_persist_every: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    mode: str
    source: int | None  # layer whose latent / index keys this layer reads (None: own or none)
    m: int
    global_bytes_per_token: float  # main latent entries this layer itself stores
    index_bytes_per_token: float  # index keys this layer itself stores
    swa_bytes: int  # SWA KV held for one sequence (window entries), not per token


def v41_modes(layers: int = 40) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """V4.1's layer pattern scaled to `layers`: two pure-SWA layers; encoder (below L/2) CSA2 at
    m = 2 with a Full layer every 3L/20 from layer 2; decoder at m = 1 with its Full layer at L/2
    and a Reindex layer every L/10 after it; every other layer Reuse. At 40 layers: Full 2, 8, 14,
    20 and Reindex 24, 28, 32, 36, as published."""
    half = layers // 2
    enc_step, dec_step = max(2, 3 * layers // 20), max(2, layers // 10)
    full = set(range(2, half, enc_step)) | {half}
    reindex = set(range(half + dec_step, layers, dec_step))
    modes = tuple(
        "swa" if i < 2 else "full" if i in full else "reindex" if i in reindex else "reuse"
        for i in range(layers)
    )
    return modes, tuple(0 if i < 2 else 2 if i < half else 1 for i in range(layers))


def _v4_modes() -> tuple[tuple[str, ...], tuple[int, ...]]:

    cfg = DeepseekV4Config()
    modes = tuple("csa" if t == "compressed_sparse_attention" else "hca" for t in cfg.layer_types)
    return modes, tuple(cfg.compress_rates[t] for t in cfg.layer_types)


def presets() -> dict[str, V41Layout]:
    full_modes, full_m = v41_modes()
    v4_modes, v4_m = _v4_modes()
    tiny_modes, tiny_m = v41_modes(8)
    return {
        "v41-flash": V41Layout("v41-flash", 40, 5120, modes=full_modes, m=full_m),
        "v4-flash": V41Layout(
            "v4-flash", len(v4_modes), 4096, index_heads=64, modes=v4_modes, m=v4_m,
            # V4: non-RoPE channels FP8 (one fp32 scale per entry: our fp8 codec), RoPE channels BF16;
            # indexer keys FP8 as in V3.2; the SWA window kept in the same format as the main entry.
            main_entry=(("fp8", 448), ("bf16", 64)),
            index_entry=(("fp8", 128),),
            swa_entry=(("fp8", 448), ("bf16", 64)),
            swa_persist_every=1024,
            notes=(
                "assumption: V4's persistent cache stored each cached prefix's SWA window once per 1,024 "
                "tokens",
            ),
        ),
        "tiny-v41": V41Layout(
            "tiny-v41", 8, 64, window=8, latent_dim=32, rope_dim=8, index_dim=16, index_heads=2, topk=8,
            modes=tiny_modes, m=tiny_m, main_entry=(("nvfp4:tensor_scale=0", 32),),
            index_entry=(("mxfp4", 16),), swa_entry=(("fp8", 32),),
        ),
    }


def _source(modes: tuple[str, ...], i: int) -> int | None:
    if modes[i] in ("full", "swa", "csa", "hca"):
        return None
    return max(j for j in range(i) if modes[j] == "full")


def cache_plan(cfg: V41Layout) -> list[LayerPlan]:
    """Per-layer cache plan; V4.1 Reindex / Reuse layers store nothing global of their own."""
    main, index, swa = entry_bytes(cfg.main_entry), entry_bytes(cfg.index_entry), entry_bytes(cfg.swa_entry)
    plan = []
    for i, (mode, m) in enumerate(zip(cfg.modes, cfg.m)):
        owns = mode in ("full", "csa", "hca")
        g = main / m if owns else 0.0
        ix = index / m if mode in ("full", "csa") else 0.0
        rows = 2 if cfg.swa_values and mode == "swa" else 1
        plan.append(LayerPlan(i, mode, _source(cfg.modes, i), m, g, ix, cfg.window * swa * rows))
    return plan


def totals(cfg: V41Layout) -> dict:
    """Global KV bytes per token, SWA bytes per sequence, and what a persistent cache holds per token."""
    plan = cache_plan(cfg)
    global_kv = sum(p.global_bytes_per_token + p.index_bytes_per_token for p in plan)
    swa = sum(p.swa_bytes for p in plan)
    persisted_swa = swa / cfg.swa_persist_every if cfg.swa_persist_every else 0.0
    return {
        "preset": cfg.name,
        "global_kv_bytes_per_token": global_kv,
        "main_entry_bytes": entry_bytes(cfg.main_entry),
        "index_key_bytes": entry_bytes(cfg.index_entry),
        "swa_bytes_per_sequence": swa,
        "persistent_bytes_per_token": global_kv + persisted_swa,
        "notes": list(cfg.notes),
    }


def compare(preset: str = "v41-flash", baseline: str = "v4-flash") -> dict:
    """The preset's totals and its ratios to the baseline (global KV, persistent cache)."""
    p = presets()
    a, b = totals(p[preset]), totals(p[baseline])
    return {
        **a,
        "baseline": b,
        "global_ratio_to_baseline": a["global_kv_bytes_per_token"] / b["global_kv_bytes_per_token"],
        "persistent_ratio_to_baseline": a["persistent_bytes_per_token"] / b["persistent_bytes_per_token"],
    }
