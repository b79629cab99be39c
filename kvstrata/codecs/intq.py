"""KIVI-style asymmetric integer codes (INT4 / INT2): per group of `group` elements an fp16 scale
and an fp16 minimum; `x ~ min + code * scale`, codes round half to even and clamp to [0, 2^bits-1].
Which axis the groups run along (keys per channel, values per token) is the cache's choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import check_finite, from_blocks, pack_bits, to_blocks, unpack_bits
from kvstrata.codecs.qtensor import QTensor

FP16_MAX = 65504.0


@dataclass(frozen=True)
class _IntCodec:
    group: int = 32
    bits: ClassVar[int] = 4

    def __post_init__(self):
        per_byte = 8 // self.bits
        if not 0 < self.group <= 4096 or self.group % per_byte:
            raise ValueError(f"{self.name}: group must be a positive multiple of {per_byte}, at most 4096, "
                             f"got {self.group}")

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        if x.numel() and x.abs().max() > FP16_MAX / 2:
            raise ValueError(f"{self.name}: |x| exceeds {FP16_MAX / 2:g}; scales are stored in fp16")
        b = to_blocks(x, self.group)
        qmax = (1 << self.bits) - 1
        lo = b.amin(-1).half()
        scale = ((b.amax(-1) - lo.float()).clamp_min(0) / qmax).half()  # fp16 may round the min up
        s = scale.float()[..., None]
        q = torch.where(s > 0, ((b - lo.float()[..., None]) / s.clamp(min=1e-30)).round(), 0.0)
        codes = pack_bits(q.clamp(0, qmax), self.bits)
        return QTensor(self, tuple(x.shape), x.dtype, {"codes": codes, "scales": scale, "mins": lo})

    def decode(self, q: QTensor) -> torch.Tensor:
        codes = unpack_bits(q.parts["codes"], self.bits).float()
        values = q.parts["mins"].float()[..., None] + codes * q.parts["scales"].float()[..., None]
        return from_blocks(values, q.shape)


@dataclass(frozen=True)
class INT4(_IntCodec):
    name: ClassVar[str] = "int4"
    summary: ClassVar[str] = "INT4 asymmetric, fp16 scale + min per group (KIVI axes in the cache)"
    bits: ClassVar[int] = 4


@dataclass(frozen=True)
class INT2(_IntCodec):
    name: ClassVar[str] = "int2"
    summary: ClassVar[str] = "INT2 asymmetric, fp16 scale + min per group (KIVI axes in the cache)"
    bits: ClassVar[int] = 2
