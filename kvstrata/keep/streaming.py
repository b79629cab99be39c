"""StreamingLLM: keep the first `sinks` tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.keep.base import budget, check_fraction


@dataclass(frozen=True)
class StreamingLLM:
    keep: float = 0.25
    sinks: int = 4
    name: ClassVar[str] = "streaming"
    summary: ClassVar[str] = "StreamingLLM: attention sinks + recent window, a `keep` fraction of the context"
    needs_scores: ClassVar[bool] = False

    def __post_init__(self):
        check_fraction(self.name, self.keep)
        if not 0 <= self.sinks <= 1 << 24:
            raise ValueError(f"streaming: sinks must be in [0, {1 << 24}], got {self.sinks}")

    def select(self, keys: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        b, h, n, _ = keys.shape
        k = budget(self.keep, n, min(n, self.sinks + 1))
        sinks = min(self.sinks, k)
        idx = torch.cat([torch.arange(sinks), torch.arange(n - (k - sinks), n)])
        return idx.to(keys.device).expand(b, h, k).contiguous()
