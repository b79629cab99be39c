"""TOVA (Oren et al., 2024): keep the positions the context's last query attends to most.

Scores are the last prompt token's attention probabilities, averaged over the query heads of each
KV group (`heads=group`, as the paper's per-head policy does with grouped queries) or over every
head of the layer (`heads=all`, as kvpress's TOVAPress does, one selection shared by all KV
heads). The last position is always kept. Applied once, after the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.keep.base import budget, check_fraction


@dataclass(frozen=True)
class TOVA:
    keep: float = 0.25
    heads: str = "group"
    name: ClassVar[str] = "tova"
    summary: ClassVar[str] = "TOVA: the last query's attention, per KV group (or all heads), top positions"
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
