"""FP4 E2M1 element format: 1 sign, 2 exponent (bias 1), 1 mantissa bit; no Inf/NaN.

Magnitudes of codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is to nearest with ties to the
even code; magnitudes above 6 saturate to 6. Code 8 (-0) is never produced: zero is always +0.
"""

from __future__ import annotations

import functools

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Midpoints between neighbouring magnitudes. A tie goes to the even code, i.e. down when the
# lower neighbour's code is even (0.25, 1.25, 2.5, 5) and up otherwise (0.75, 1.75, 3.5).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


@functools.lru_cache(maxsize=None)
def _above(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every midpoint as a strict "above" test in `dtype`: a >= t is a > (the number just below t). A
    magnitude's code is then how many of these it lies above (one bucketize, not seven compares)."""
    up = [torch.nextafter(torch.tensor(t, dtype=dtype), torch.tensor(0.0, dtype=dtype)) for t in _TIES_UP]
    return torch.cat([torch.tensor(_TIES_DOWN, dtype=dtype), torch.stack(up)]).sort().values.to(device)


# codes 0..15 -> values (bit 3 the sign; code 8 is -0.0)
_VALUES = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """`x` float (already scaled) -> uint8 codes 0..15 (bit 3 = sign), same shape."""
    a = x.abs() if x.dtype == torch.float64 else x.abs().float()  # narrower floats widen exactly
    mag = torch.bucketize(a, _above(a.dtype, a.device), out_int32=True).to(torch.uint8)
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    table = _VALUES if _VALUES.device == codes.device else _VALUES.to(codes.device)
    return table[codes.long()]


def _pair_table() -> torch.Tensor:
    """`[256, 2]` float32: the two E2M1 values packed in each byte (low nibble first)."""
    codes = torch.arange(256, dtype=torch.uint8)
    return torch.stack([decode_e2m1(codes & 15), decode_e2m1(codes >> 4)], dim=-1)


_PAIRS = _pair_table()


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., m]` (two codes per byte, low nibble first) -> float32 `[..., 2m]`, one lookup."""
    table = _PAIRS if _PAIRS.device == packed.device else _PAIRS.to(packed.device)
    return table[packed.long()].reshape(*packed.shape[:-1], packed.shape[-1] * 2)
