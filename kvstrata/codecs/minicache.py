"""MiniCache (Liu et al., 2024): merge adjacent layers' K/V by SLERP of their directions.

For a pair of adjacent layers (from `start` of the depth on, where layers are most alike), each
token's two vectors are split into magnitude and direction; the directions are merged by
spherical interpolation at `t` and stored once, the per-layer magnitudes are kept, and the `gamma`
share of tokens whose directions differ most are kept unmerged in both layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.base import Codec
from kvstrata.codecs.qtensor import QTensor, held_bytes


@dataclass(frozen=True)
class MiniCache:
    start: float = 0.5
    t: float = 0.6
    gamma: float = 0.05
    block: int = 64
    g: ClassVar[int] = 2
    name: ClassVar[str] = "minicache"
    summary: ClassVar[str] = (
        "MiniCache: SLERP-merge adjacent layers' KV directions (deeper half), magnitudes kept"
    )

    def __post_init__(self):
        if (
            not 0.0 <= self.start < 1.0
            or not 0.0 <= self.t <= 1.0
            or not 0.0 <= self.gamma <= 1.0
            or not 1 <= self.block <= 65536
        ):
            raise ValueError(
                "minicache: need 0 <= start < 1, 0 <= t <= 1, 0 <= gamma <= 1, 1 <= block <= 65536; got "
                f"{self}"
            )

    def encode(self, k: torch.Tensor, v: torch.Tensor, queries, codec: Codec, state: dict) -> "MergedBlock":
        """`k, v: [2, b, h, T, d]` -> MergedBlock."""
        return MergedBlock(k.shape[-2], [self._merge(x, codec) for x in (k, v)])

    def _merge(self, x: torch.Tensor, c) -> dict:
        norms = x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        u = x / norms
        cos = (u[0] * u[1]).sum(-1, keepdim=True).clamp(-1.0, 1.0)
        theta = torch.arccos(cos)
        sin = torch.sin(theta).clamp(min=1e-6)
        w0 = torch.where(
            theta > 1e-4, torch.sin((1 - self.t) * theta) / sin, torch.full_like(theta, 1 - self.t)
        )
        w1 = torch.where(theta > 1e-4, torch.sin(self.t * theta) / sin, torch.full_like(theta, self.t))
        merged = w0 * u[0] + w1 * u[1]
        tokens = x.shape[-2]
        keep = math.ceil(self.gamma * tokens)
        idx = theta[..., 0].topk(keep, dim=-1).indices.sort(-1).values  # most distinct tokens: unmerged
        kept = torch.stack(
            [x[j].gather(-2, idx[..., None].expand(-1, -1, -1, x.shape[-1])) for j in range(2)]
        )
        return {
            "dir": c.encode(merged), "norms": norms[..., 0].half(), "idx": idx.to(torch.int32),
            "kept": c.encode(kept),
        }


def _decode(part: dict, j: int, dtype) -> torch.Tensor:
    """Layer `j` of one merged pair: shared direction x its own magnitudes, unmerged tokens put back."""
    x = part["dir"].dequantize(torch.float32) * part["norms"][j].float()[..., None]
    idx = part["idx"].long()[..., None].expand(-1, -1, -1, x.shape[-1])
    return x.scatter(-2, idx, part["kept"].dequantize(torch.float32)[j]).to(dtype)


class MergedBlock:
    #: merged layers have no per-layer codes a decode step could read as they are (`DepthBlock.layers`)
    layers = None

    def __init__(self, tokens: int, parts: list[dict]):
        self.tokens, self.parts = tokens, parts

    def nbytes(self) -> int:
        return held_bytes(
            t
            for p in self.parts
            for v in p.values()
            for t in (v.parts.values() if isinstance(v, QTensor) else [v])
        )

    def layer(self, j: int, g: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _decode(self.parts[0], j, dtype), _decode(self.parts[1], j, dtype)
