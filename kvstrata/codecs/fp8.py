"""FP8 E4M3 with one float32 scale per block (per token when `block=0`), as V4.1 stores SWA KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import check_finite, from_blocks, to_blocks
from kvstrata.codecs.qtensor import QTensor

E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8:
    """`block`: elements sharing a scale along the last dim; 0 = the whole last dim (per token)."""

    block: int = 0
    name: ClassVar[str] = "fp8"
    summary: ClassVar[str] = "FP8 E4M3, 8 bits per element + one fp32 scale per block (block=0: per token)"

    def __post_init__(self):
        if not 0 <= self.block <= 4096:
            raise ValueError(f"fp8: block must be in [0, 4096] (0 = one scale per row), got {self.block}")

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        b = to_blocks(x, self.block or x.shape[-1])
        scale = b.abs().amax(-1) / E4M3_MAX
        # an all-zero block, or one so small its scale underflows float32, encodes as zeros under scale 1
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (b / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype,
                       parts={"codes": codes, "scales": scale})

    def decode(self, q: QTensor) -> torch.Tensor:
        values = q.parts["codes"].view(torch.float8_e4m3fn).float() * q.parts["scales"][..., None]
        return from_blocks(values, q.shape)
