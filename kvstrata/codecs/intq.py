"""KIVI-style asymmetric integer codes (INT4 / INT3 / INT2): per group of `group` elements an fp16 scale
and an fp16 minimum; `x ~ min + code * scale`, codes round half to even and clamp to [0, 2^bits-1].
INT3 packs 8 codes in 3 bytes (one bit stream), so its groups are multiples of 8.
Which axis the groups run along (keys per channel, values per token) is the cache's choice.

`fit="lsq"` picks each group's scale and minimum for least squared error instead of from its range:
a few rounds of "round to codes, refit x ~ min + code * scale by least squares" (clipping where a
far element costs the rest more than it gains), kept per group only where it beats min-max. The
stored format and decoding are the same; only encoding takes longer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import (
    check_finite,
    check_fit,
    codes_per_unit,
    from_blocks,
    pack_bits,
    to_blocks,
    unpack_bits,
)
from kvstrata.codecs.qtensor import QTensor

FP16_MAX = 65504.0
LSQ_ROUNDS = 8


def _codes(b: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Codes (float) of blocks `b` under per-block fp16 `lo` and `scale` (`[..., 1]`, as float)."""
    return torch.where(scale > 0, ((b - lo) / scale.clamp(min=1e-30)).round().clamp(0, qmax), 0.0)


def fit_lsq(b: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, qmax: int):
    """Refine min-max `lo, scale` (`[..., 1]`, fp16-representable floats) of blocks `b: [..., g]`
    toward least squared error; returns fp16-representable `(lo, scale)`, per block never worse."""
    best_lo, best_s = lo, scale
    q = _codes(b, lo, scale, qmax)
    best_err = ((lo + q * scale - b) ** 2).sum(-1, keepdim=True)
    xm = b.mean(-1, keepdim=True)
    for _ in range(LSQ_ROUNDS):  # each round: refit the line to the codes, then re-round under it
        qc = q - q.mean(-1, keepdim=True)
        var = (qc * qc).mean(-1, keepdim=True)
        slope = torch.where(var > 0, (qc * (b - xm)).mean(-1, keepdim=True) / var.clamp(min=1e-30), scale)
        scale = slope.clamp_min(0).half().float()
        lo = (xm - scale * q.mean(-1, keepdim=True)).half().float()
        q = _codes(b, lo, scale, qmax)
        err = ((lo + q * scale - b) ** 2).sum(-1, keepdim=True)
        better = err < best_err  # NaN / inf from an fp16 overflow never wins
        best_lo, best_s = torch.where(better, lo, best_lo), torch.where(better, scale, best_s)
        best_err = torch.where(better, err, best_err)
    return best_lo, best_s


@dataclass(frozen=True)
class _IntCodec:
    group: int = 32
    fit: str = "minmax"
    bits: ClassVar[int] = 4

    def __post_init__(self):
        check_fit(self.name, self.fit)
        unit = codes_per_unit(self.bits)
        if not 0 < self.group <= 4096 or self.group % unit:
            raise ValueError(f"{self.name}: group must be a positive multiple of {unit}, at most 4096, "
                             f"got {self.group}")

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        if x.numel() and x.abs().max() > FP16_MAX / 2:
            raise ValueError(f"{self.name}: |x| exceeds {FP16_MAX / 2:g}; scales are stored in fp16")
        b = to_blocks(x, self.group)
        qmax = (1 << self.bits) - 1
        lo = b.amin(-1, keepdim=True).half().float()
        # clamped: fp16 may round the min up
        scale = ((b.amax(-1, keepdim=True) - lo).clamp_min(0) / qmax).half().float()
        if self.fit == "lsq":
            lo, scale = fit_lsq(b, lo, scale, qmax)
        codes = pack_bits(_codes(b, lo, scale, qmax), self.bits)
        parts = {"codes": codes, "scales": scale[..., 0].half(), "mins": lo[..., 0].half()}
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype, parts=parts)

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
class INT3(_IntCodec):
    name: ClassVar[str] = "int3"
    summary: ClassVar[str] = "INT3 asymmetric, fp16 scale + min per group (KIVI axes in the cache)"
    bits: ClassVar[int] = 3


@dataclass(frozen=True)
class INT2(_IntCodec):
    name: ClassVar[str] = "int2"
    summary: ClassVar[str] = "INT2 asymmetric, fp16 scale + min per group (KIVI axes in the cache)"
    bits: ClassVar[int] = 2
