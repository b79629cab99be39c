"""TOVA (Oren et al., 2024): keep the positions the context's last query attends to most.

Scores are the last prompt token's attention probabilities averaged over every head of the layer
(`heads=all`, the default: one selection shared by the layer's KV heads, as the paper's policy and
kvpress's TOVAPress do), or over the query heads of each KV group only (`heads=group`: each KV head
keeps its own positions). The last position is always kept. Applied once, after the prefill.
On SmolLM2 4k the shared selection keeps the single needle in 3 of 3 instances, per-group
selection in 0 of 3 (docs/benchmark.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.keep.base import budget, check_fraction


@dataclass(frozen=True)
class TOVA:
    keep: float = 0.25
    heads: str = "all"
    name: ClassVar[str] = "tova"
    summary: ClassVar[str] = "TOVA: the last query's attention over all heads (or per KV group), top tokens"
    needs_scores: ClassVar[bool] = True
    window: ClassVar[int] = 1  # the observation window: the last prompt token's query

    def __post_init__(self):
        check_fraction(self.name, self.keep)
        if self.heads not in ("group", "all"):
            raise ValueError(f"tova: heads must be 'group' or 'all', got {self.heads!r}")

    def select(self, keys: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        if scores is None:
            raise ValueError("tova needs the last query's attention scores")
        b, h, n, _ = keys.shape
        s = scores.float()
        if self.heads == "all":
            s = s.mean(1, keepdim=True).expand(b, h, n)
        s = s.clone()
        s[..., n - 1] = float("inf")  # the last position is always kept
        idx = s.topk(budget(self.keep, n, 1), dim=-1).indices
        return idx.sort(dim=-1).values
