"""NVFP4: 16 E2M1 elements share a positive E4M3 scale, plus one optional fp32 tensor scale.

`block_scale = (block_amax / 6) / tensor_scale` cast (saturating) to E4M3, with
`tensor_scale = amax / (448 * 6)` so the largest block scale lands on E4M3's maximum.
9 bytes per 16 elements, plus 4 bytes per tensor when `tensor_scale=1`.

`fit="lsq"` gives each block the scale, of those mapping its largest magnitude to 6, 5 or 4, with the
least squared error (a block of spread values loses less to rounding on a finer grid than to
clipping none; "four over six" block scaling). Same format and decoding; encoding takes longer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import check_finite, check_fit, from_blocks, pack_bits, to_blocks
from kvstrata.codecs.e2m1 import E2M1_MAX, decode_e2m1, decode_e2m1_packed, encode_e2m1
from kvstrata.codecs.fp8 import E4M3_MAX
from kvstrata.codecs.qtensor import QTensor

NV_BLOCK = 16
TENSOR_SCALE_FLOOR = 2.0**-100
LSQ_TOPS = (5.0, 4.0)  # what a block's largest magnitude may map to besides E2M1's 6


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor scale NVFP4 picks for a tensor whose largest magnitude is `amax`: below 2^-100
    the scale would be subnormal (inexact arithmetic), so such a tensor keeps 1, its blocks' E4M3
    scales underflow and it encodes as zeros."""
    wanted = amax.float() / (E4M3_MAX * E2M1_MAX)
    return torch.where(wanted >= TENSOR_SCALE_FLOOR, wanted, torch.ones_like(wanted)).reshape(())


def _blocks_under(b: torch.Tensor, amax_block: torch.Tensor, top: float, ts: torch.Tensor):
    """(E4M3 block scales, effective scales, scaled blocks) when each block's largest magnitude maps
    to `top` (saturating E4M3; a block whose scale underflows encodes as zeros)."""
    block_scale = (amax_block / top / ts).to(torch.float8_e4m3fn)
    eff = block_scale.float() * ts
    tiny = torch.finfo(torch.float32).tiny
    scaled = torch.where(eff[..., None] > 0, b / eff.clamp(min=tiny)[..., None], 0.0)
    return block_scale, eff, scaled


def _error(b: torch.Tensor, eff: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Squared error per block of reading `scaled` back as E2M1 times `eff`."""
    return ((decode_e2m1(encode_e2m1(scaled)) * eff[..., None] - b) ** 2).sum(-1)


# returns the built C++ module (its `encode_nvfp4`) or None; the read stratum's kernel loader
# (`kvstrata.read.kernels.cpu`, which builds it) registers itself here, so the codec imports nothing above it
_native_loader: Callable[[], object | None] | None = None


def use_native(loader: Callable[[], object | None]) -> None:
    """Encode through `loader()`'s `encode_nvfp4` where it gives a module (the same codes, faster)."""
    global _native_loader
    _native_loader = loader


def _native(x: torch.Tensor):
    """The C++ module when `x` (non-empty, on the CPU) can be encoded by it, else None."""
    if _native_loader is None or x.device.type != "cpu" or x.numel() == 0:
        return None
    return _native_loader()


@dataclass(frozen=True)
class NVFP4:
    tensor_scale: bool = True
    fit: str = "minmax"
    name: ClassVar[str] = "nvfp4"
    summary: ClassVar[str] = "NVFP4: E2M1 + one E4M3 scale per 16 elements (+ fp32 tensor scale), 4.5 bits"

    def __post_init__(self):
        check_fit(self.name, self.fit)

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> QTensor:
        """`scale`: a tensor scale to use instead of this tensor's own (parts of one tensor encoded
        apart, with the whole tensor's `tensor_scale(amax)`, encode exactly as the whole does), or one
        per batch row, `[b, 1, 1, 1]` (rows of several tensors encoded at once). A minmax fit on the
        CPU encodes in the C++ kernel when it is built (the same codes, tested bit for bit)."""
        native = _native(x) if self.fit == "minmax" else None
        if native is not None:
            check_finite(x, self.name)
            b = to_blocks(x, NV_BLOCK)
            ts = self._tensor_scale(b, scale)
            codes, block_scale = native.encode_nvfp4(
                b.reshape(-1, NV_BLOCK).contiguous(), ts.expand(b.shape[:-1]).reshape(-1).contiguous())
            parts = {"codes": codes.reshape(*b.shape[:-1], NV_BLOCK // 2),
                     "scales": block_scale.reshape(b.shape[:-1])}
        else:
            ts, block_scale, eff, scaled = self._scaled(x, scale)
            parts = {"codes": pack_bits(encode_e2m1(scaled), 4), "scales": block_scale.view(torch.uint8)}
        if self.tensor_scale:
            parts["tensor_scale"] = ts.reshape(-1)
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype, parts=parts)

    def round_trip(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """What `x` reads back as, float32: `decode(encode(x, scale))` without packing the codes."""
        _, _, eff, scaled = self._scaled(x, scale)
        return from_blocks(decode_e2m1(encode_e2m1(scaled)) * eff[..., None], tuple(x.shape))

    def _scaled(self, x: torch.Tensor, scale: torch.Tensor | None):
        """(tensor scale, E4M3 block scales, effective block scales, blocks divided by them)."""
        check_finite(x, self.name)
        b = to_blocks(x, NV_BLOCK)
        amax_block = b.abs().amax(-1)
        ts = self._tensor_scale(b, scale)
        block_scale, eff, scaled = _blocks_under(b, amax_block, E2M1_MAX, ts)
        if self.fit == "lsq":
            err = _error(b, eff, scaled)
            for top in LSQ_TOPS:
                c_scale, c_eff, c_scaled = _blocks_under(b, amax_block, top, ts)
                c_err = _error(b, c_eff, c_scaled)
                better = c_err < err
                block_scale = torch.where(better, c_scale, block_scale)
                eff, err = torch.where(better, c_eff, eff), torch.where(better, c_err, err)
                scaled = torch.where(better[..., None], c_scaled, scaled)
        return ts, block_scale, eff, scaled

    def _tensor_scale(self, b: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The tensor scale blocks `b` encode under: `scale` as given (one, or one per batch row),
        else their own, else 1 (no tensor scale)."""
        if not self.tensor_scale:
            return torch.ones((), dtype=torch.float32, device=b.device)
        if scale is not None:
            return scale.float().reshape(() if scale.numel() == 1 else (-1, 1, 1, 1))
        return tensor_scale(b.abs().amax() if b.numel() else b.new_zeros(()))

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The tensor scale for a tensor whose largest magnitude is `amax`."""
        return tensor_scale(amax) if self.tensor_scale else torch.ones(())

    def fits(self, x: torch.Tensor, scale: torch.Tensor) -> bool:
        """Whether `x` can be encoded under the held tensor `scale` as well as under its own: its
        largest block scale neither saturates E4M3 nor falls below E4M3's normal range."""
        amax = float(x.abs().amax()) if x.numel() else 0.0
        top = float(scale) * E4M3_MAX * E2M1_MAX
        return top * 2.0**-6 / E4M3_MAX <= amax <= top

    def decode(self, q: QTensor) -> torch.Tensor:
        scale = q.parts["scales"].view(torch.float8_e4m3fn).float()
        if "tensor_scale" in q.parts:
            scale = scale * q.parts["tensor_scale"]
        values = decode_e2m1_packed(q.parts["codes"]) * scale[..., None]
        return from_blocks(values, q.shape)
