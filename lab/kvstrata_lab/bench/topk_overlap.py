"""`kvstrata topk-overlap`: how much the top-k positions of different layers overlap on a real model.

The evidence for Reuse / Reindex schedules: for the context's last queries, each full-attention
layer's exact top-k (per KV head) is compared with every other layer's; the mean overlap
|A ∩ B| / k is written as a layers × layers heat map.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from kvstrata.hf.probe import probing
from kvstrata.hf.run import forward
from kvstrata.models import load
from kvstrata.read.indexers import exact
from kvstrata_lab.bench.corpus import natural_ids


def overlap_matrix(model, ids: torch.Tensor, k: int, queries: int = 8) -> tuple[list[int], torch.Tensor]:
    cache = DynamicCache(config=model.config)
    forward(model, ids[:, :-queries], cache)
    with probing(model) as rec:
        forward(model, ids[:, -queries:], cache)
    layers = [i for i, layer in enumerate(cache.layers) if not getattr(layer, "is_sliding", False)]
    tops = {}
    for i in layers:
        keys = cache.layers[i].keys
        picks = []
        for t in range(queries):
            n = keys.shape[-2] - queries + t + 1  # causal: what query t may see
            scores = exact(rec.queries[i][:, :, t : t + 1], keys[..., :n, :])
            picks.append(scores.topk(min(k, n), -1).indices)
        tops[i] = picks
    m = torch.zeros(len(layers), len(layers))
    for a, i in enumerate(layers):
        for b, j in enumerate(layers):
            share = []
            for pi, pj in zip(tops[i], tops[j]):
                hits = (pi[..., :, None] == pj[..., None, :]).any(-1).float().mean()
                share.append(hits)
            m[a, b] = torch.stack(share).mean()
    return layers, m


def run(model_names: list[str], tokens: int, k: int, out: Path) -> dict:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name in model_names:
        model, tok = load(name)
        ids = torch.tensor([natural_ids(tok, tokens, seed=5)])
        layers, m = overlap_matrix(model, ids, k)
        adjacent = [m[a, a + 1].item() for a in range(len(layers) - 1)]
        result[name] = {"layers": layers, "k": k, "tokens": ids.shape[1],
            "overlap": m.tolist(), "adjacent": adjacent}
        fig, ax = plt.subplots(figsize=(6, 5))
        im = ax.imshow(m.numpy(), vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(layers)), layers, fontsize=6)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_title(f"{name}: top-{k} overlap between full-attention layers")
        fig.colorbar(im)
        fig.tight_layout()
        fig.savefig(out / f"topk_overlap_{name}.png", dpi=100)
        plt.close(fig)
    (out / "topk_overlap.json").write_text(json.dumps(result, indent=1))
    return result
