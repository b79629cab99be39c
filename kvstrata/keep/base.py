"""Keep stratum contract: after the context is prefilled, choose which positions each KV head keeps."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch


class KeepPolicy(Protocol):
    name: ClassVar[str]
    summary: ClassVar[str]
    #: whether `select` needs observation-window attention scores
    needs_scores: ClassVar[bool]
    #: with `needs_scores`: how many of the context's last queries the scores are summed over
    window: int
    keep: float

    def select(self, keys: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """`keys: [batch, kv_heads, n, head_dim]`, `scores: [batch, kv_heads, n]` or None ->
        kept positions `[batch, kv_heads, k]` int64, ascending, k = `budget(n)`."""
        ...


def budget(keep: float, n: int, floor: int) -> int:
    """Tokens kept out of `n` for a kept fraction `keep` (never fewer than `floor`, never more than n)."""
    return min(n, max(floor, round(keep * n)))


def check_fraction(name: str, keep: float) -> None:
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"{name}: keep must be a fraction in (0, 1], got {keep}")
