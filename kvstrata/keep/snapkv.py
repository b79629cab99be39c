"""SnapKV: keep the positions the context's last `window` queries attend to most.

Scores are the observation window's attention probabilities summed over its queries, averaged
over the query heads that share a KV head (GQA-aware), then max-pooled along positions so that
neighbours of a hit survive with it. The window itself is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvstrata.keep.base import budget, check_fraction


def window_rows(attn: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`attn: [batch, q_heads, window, n]` attention probabilities -> `[batch, kv_heads, window, n]`,
    averaged over the query heads that share a KV head (GQA-aware)."""
    b, hq, w, n = attn.shape
    return attn.float().reshape(b, kv_heads, hq // kv_heads, w, n).mean(2)


def window_scores(attn: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`attn: [batch, q_heads, window, n]` -> `[batch, kv_heads, n]`: the window's rows summed (the
    scores keep policies rank positions by; a policy with a window of w sums the last w rows)."""
    return window_rows(attn, kv_heads).sum(2)


@dataclass(frozen=True)
class SnapKV:
    keep: float = 0.25
    window: int = 32
    pool: int = 7
    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "SnapKV: observation-window attention, pooled, GQA-aware top positions"
    needs_scores: ClassVar[bool] = True

    def __post_init__(self):
        check_fraction(self.name, self.keep)
        if not 1 <= self.window <= 65536 or not 1 <= self.pool <= 255 or self.pool % 2 == 0:
            raise ValueError(f"snapkv: window must be in [1, 65536] and pool an odd number in [1, 255], "
                             f"got {self.window}, {self.pool}")

    def select(self, keys: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        if scores is None:
            raise ValueError("snapkv needs observation-window attention scores (run it through the bench "
                             "protocol)")
        b, h, n, _ = keys.shape
        w = min(self.window, n)
        k = budget(self.keep, n, w)
        pooled = F.max_pool1d(scores.reshape(b * h, 1, n).float(),
                              self.pool, stride=1, padding=self.pool // 2)
        pooled = pooled.reshape(b, h, n)
        pooled[..., n - w :] = float("inf")  # the window itself is always kept
        idx = pooled.topk(k, dim=-1).indices
        return idx.sort(dim=-1).values
