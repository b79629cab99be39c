"""Choosing the next token: greedy at temperature 0, else seeded sampling with nucleus (top-p)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax), as `kvstrata generate`
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request

    def __post_init__(self):
        if not 0 <= self.temperature <= 2 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be in [0, 2] and top_p in (0, 1], got {self.temperature}, "
                             f"{self.top_p}")


class Sampler:
    """One request's token chooser; its own `torch.Generator`, so requests never share random state."""

    def __init__(self, params: Sampling):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed % 2**64)

    def __call__(self, logits: torch.Tensor) -> int:
        """`logits: [1, vocab]` -> a token id."""
        if self.generator is None:
            return int(logits[0].argmax())
        probs = torch.softmax(logits[0].float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # mass before this token already >= top_p
            outside = sorted_p.cumsum(0) - sorted_p >= self.params.top_p
            sorted_p[outside] = 0
            return int(order[torch.multinomial(sorted_p, 1, generator=self.generator)])
        return int(torch.multinomial(probs, 1, generator=self.generator))
