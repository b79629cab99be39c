"""MXFP4 (OCP MX v1.0): 32 E2M1 elements share one E8M0 power-of-two scale; 17 bytes per 32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import check_finite, from_blocks, pack_bits, to_blocks
from kvstrata.codecs.e2m1 import decode_e2m1_packed, encode_e2m1
from kvstrata.codecs.qtensor import QTensor

MX_BLOCK = 32
E8M0_BIAS = 127


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact `floor(log2(x))` for positive finite float32 (subnormals included), int32."""
    _, exp = torch.frexp(x)
    return exp - 1


def pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact float32 `2**exp` for int `exp` in [-127, 127], built from the bit pattern."""
    normal = ((exp.clamp(min=-126) + 127).to(torch.int32) << 23).view(torch.float32)
    return torch.where(exp >= -126, normal, torch.full_like(normal, 2.0**-127))


@dataclass(frozen=True)
class MXFP4:
    name: ClassVar[str] = "mxfp4"
    summary: ClassVar[str] = "MXFP4: E2M1 + one E8M0 scale per 32 elements, 4.25 bits per element"

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        b = to_blocks(x, MX_BLOCK)
        amax = b.abs().amax(-1)
        exp = floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - 2
        exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
        codes = encode_e2m1(b / pow2(exp)[..., None])  # |x| in (6, 8) * 2^exp saturates to 6
        parts = {"codes": pack_bits(codes, 4), "scales": (exp + E8M0_BIAS).to(torch.uint8)}
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype, parts=parts)

    def decode(self, q: QTensor) -> torch.Tensor:
        scale = pow2(q.parts["scales"].to(torch.int32) - E8M0_BIAS)
        values = decode_e2m1_packed(q.parts["codes"]) * scale[..., None]
        return from_blocks(values, q.shape)
