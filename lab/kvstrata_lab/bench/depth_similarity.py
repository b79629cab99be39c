"""`kvstrata depth-similarity`: how alike adjacent layers' K and V are, per head, on a real model.

The evidence for where depth sharing (FreqDepthKV, MiniCache) can work: per adjacent layer pair
and KV head, the mean cosine similarity of K (and V) over tokens; per group of G adjacent layers
and head, the share of energy in the lowest depth frequency of a DCT across the group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from kvstrata.codecs.depth_dct import low_energy_share
from kvstrata.hf.run import forward
from kvstrata.models import load
from kvstrata_lab.bench.corpus import natural_ids


def layer_kv(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every layer over the positions all layers hold: `[layers, kv_heads, T, head_dim]`."""
    cache = DynamicCache(config=model.config)
    forward(model, ids, cache)
    t = min(layer.keys.shape[-2] for layer in cache.layers)
    k = torch.stack([layer.keys[0, :, -t:] for layer in cache.layers])
    v = torch.stack([layer.values[0, :, -t:] for layer in cache.layers])
    return k.float(), v.float()


def similarity(k: torch.Tensor, v: torch.Tensor, group: int) -> dict:
    cos = lambda a: torch.nn.functional.cosine_similarity(a[:-1], a[1:], dim=-1).mean(-1)  # noqa: E731
    n = k.shape[0] // group * group
    groups = lambda a: a[:n].reshape(n // group, group, *a.shape[1:])  # noqa: E731
    low = lambda a: torch.stack([low_energy_share(g, 1).mean(-1) for g in groups(a)])  # noqa: E731
    return {
        "k_cos": cos(k).tolist(), "v_cos": cos(v).tolist(), "k_low": low(k).tolist(),
        "v_low": low(v).tolist(), "group": group, "tokens": k.shape[2],
    }


def plot(result: dict, title: str, path: Path) -> None:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    fig, axes = plt.subplots(1, 4, figsize=(14, 4.5))
    panels = [
        ("k_cos", "K cosine, layer i vs i+1"), ("v_cos", "V cosine, layer i vs i+1"),
        ("k_low", f"K energy in lowest depth freq (G={result['group']})"),
        ("v_low", f"V energy in lowest depth freq (G={result['group']})"),
    ]
    for ax, (key, label) in zip(axes, panels):
        data = torch.tensor(result[key]).numpy()
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0 if "low" in key else -0.2, vmax=1)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer pair" if "cos" in key else "layer group")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(model_names: list[str], tokens: int, group: int, out: Path) -> dict:

    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in model_names:
        model, tok = load(name)
        ids = torch.tensor([natural_ids(tok, tokens, seed=3)])
        r = similarity(*layer_kv(model, ids), group)
        results[name] = r
        plot(r, f"{name}: adjacent-layer KV similarity ({r['tokens']} tokens)", out / f"depth_{name}.png")
    (out / "depth_similarity.json").write_text(json.dumps(results, indent=1))
    return results
