"""Indexers: score cached positions for one decode query, per KV head.

`q: [b, q_heads, 1, d]`, `k: [b, kv_heads, n, d]` -> scores `[b, kv_heads, n]`.
- exact: max over the query heads sharing the KV head of q . k;
- lightning: V4.1's form `sum_h relu(q_h . k)` over those query heads (unit head weights), on
  keys rounded through MXFP4 as V4.1 keeps its index keys.
- lowrank: the exact form on `rank`-dim index keys: K and q projected onto the top principal
  directions of the layer's prefilled keys (per KV head, fixed at the first sparse step; the
  Loki observation that attention keys are low-rank), index keys held in NVFP4.
Each splits into `index_rows` (per key row, so a decode loop computes a row once and keeps it)
and `score` (per query).
"""

from __future__ import annotations

import functools

import torch

from kvstrata.codecs import get_codec, quantize
from kvstrata.codecs.nvfp4 import tensor_scale


def key_basis(k: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` eigenvectors of each KV head's uncentred key second moment: `[b, kv_heads, d, rank]`.
    Uncentred, because the index ranks dot products, and the keys' mean direction carries them."""
    if not 1 <= rank <= k.shape[-1]:
        raise ValueError(f"topk: rank must be in 1..{k.shape[-1]} (the head dim), got {rank}")
    k = k.float()
    _, vecs = torch.linalg.eigh(k.transpose(-1, -2) @ k)
    return vecs[..., -rank:].flip(-1)


def index_rows(indexer: str, k: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row part of an indexer, `[b, kv_heads, n, d or rank]`: each key row maps to its index
    row alone, so rows computed once stay valid while the key rows they came from are unchanged."""
    if indexer == "exact":
        return k.float()
    if indexer == "lightning":  # MXFP4 blocks lie along the row: row-independent
        return quantize(k.float(), "mxfp4").dequantize() if k.shape[-2] else k.float()
    return k.float() @ basis


def held_scale(amax: torch.Tensor) -> torch.Tensor:
    """The one NVFP4 tensor scale lowrank index rows whose largest magnitude is `amax` are held under."""
    return tensor_scale(amax)


def held(indexer: str, rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Index rows as the index holds them: lowrank rows in NVFP4 under `scale` (their own when None;
    rows held apart under one scale equal the rows held together), other indexers' as they are."""
    if indexer != "lowrank" or not rows.shape[-2]:
        return rows
    return get_codec("nvfp4").round_trip(rows, scale)


def queries(indexer: str, q: torch.Tensor, heads: int, basis: torch.Tensor | None = None) -> torch.Tensor:
    """The decode query `q: [b, q_heads, 1, d]` as index rows are scored against it: per KV head its
    query heads, projected onto the lowrank basis when there is one: `[b, heads, q_per_kv, d or rank]`."""
    b, hq, _, d = q.shape
    grouped = q[:, :, 0].reshape(b, heads, hq // heads, d).float()
    return grouped @ basis if indexer == "lowrank" else grouped


def relu_sum(indexer: str) -> bool:
    """Whether the indexer sums ReLUs over a KV head's query heads (V4.1's lightning) or takes the max."""
    return indexer == "lightning"


def score(
    indexer: str, q: torch.Tensor, rows: torch.Tensor, basis: torch.Tensor | None = None
) -> torch.Tensor:
    """Scores `[b, kv_heads, n]` of index rows (`held(index_rows(...))`) for the decode query `q`."""
    logits = queries(indexer, q, rows.shape[1], basis) @ rows.float().transpose(-1, -2)
    return logits.relu().sum(2) if relu_sum(indexer) else logits.amax(2)


def exact(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return score("exact", q, index_rows("exact", k))


def lightning(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return score("lightning", q, index_rows("lightning", k))


def lowrank(q: torch.Tensor, k: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return score("lowrank", q, held("lowrank", index_rows("lowrank", k, basis)), basis)


@functools.lru_cache(maxsize=256)
def index_row_bytes(indexer: str, d: int, rank: int, k_row: float) -> float:
    """Bytes one index key takes per KV head: the K row itself (exact), an MXFP4 copy (lightning), or
    a `rank`-dim NVFP4 projection (lowrank); averaged over 256 rows so per-tensor scales amortise."""
    if indexer == "exact":
        return k_row
    fmt, dim = ("mxfp4", d) if indexer == "lightning" else ("nvfp4", rank)
    return quantize(torch.zeros(256, dim), fmt).nbytes / 256


INDEXERS = {"exact": exact, "lightning": lightning, "lowrank": lowrank}


def hierarchical(scores: torch.Tensor, k: int, block: int = 8, blocks: int | None = None) -> torch.Tensor:
    """Top-k positions found block-first: max-pool scores over blocks of `block` positions, always
    keep the newest block, take the top `blocks` blocks, then the top-k positions inside them.
    `scores: [b, h, n]` -> `[b, h, min(k, candidates)]` positions."""
    b, h, n = scores.shape
    nb = -(-n // block)
    padded = torch.full((b, h, nb * block), float("-inf"), dtype=scores.dtype)
    padded[..., :n] = scores
    pooled = padded.reshape(b, h, nb, block).amax(-1)
    pooled[..., -1] = float("inf")  # the newest block is always a candidate
    top = pooled.topk(min(blocks or max(1, 4 * k // block), nb), dim=-1).indices
    cand = (top[..., None] * block + torch.arange(block)).reshape(b, h, -1)
    cand = cand[cand < n].reshape(b, h, -1)  # every row holds the (possibly partial) newest block once
    cand_scores = scores.gather(-1, cand)
    keep = cand_scores.topk(min(k, cand.shape[-1]), dim=-1).indices
    return cand.gather(-1, keep)
