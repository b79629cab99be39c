"""Shared block plumbing for codecs: view the last dimension as blocks, pack sub-byte codes."""

from __future__ import annotations

import torch

# how a codec with a `fit` picks its scales: from their range, or for least squared error
FITS = ("minmax", "lsq")


def check_fit(codec: str, fit: str) -> None:
    """A codec's `fit` must be one it knows."""
    if fit not in FITS:
        raise ValueError(f"{codec}: fit must be one of {', '.join(FITS)}, got {fit!r}")


def check_finite(x: torch.Tensor, codec: str) -> None:
    """Codecs refuse NaN/Inf: a silently saturated KV entry is a wrong KV."""
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{codec}: input has {bad} non-finite value(s) (NaN/Inf); refusing to encode")


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x: [..., n]` -> float32 `[..., ceil(n / block), block]`, the last block padded with copies of
    the last element (so padding never widens a block's range or raises its largest magnitude)."""
    n = x.shape[-1]
    pad = (-n) % block
    x = x.float()
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    return x.reshape(*x.shape[:-1], (n + pad) // block, block)


def from_blocks(blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `to_blocks`: `[..., n_blocks, block]` -> `shape` (padding dropped)."""
    flat = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
    return flat[..., : shape[-1]].reshape(shape)


def codes_per_unit(bits: int) -> int:
    """Codes in the smallest whole-byte unit of `bits`-wide codes: 8 // bits, or 8 (in `bits` bytes)
    when `bits` does not divide 8 (INT3: 8 codes in 3 bytes)."""
    return 8 // bits if 8 % bits == 0 else 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide codes along the last dim as one little-endian bit stream: code `i`
    holds bits [i * bits, (i + 1) * bits), lowest element in the low bits."""
    if 8 % bits:  # 8 codes -> one `8 * bits`-bit word -> `bits` bytes
        c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
        word = (c << (bits * torch.arange(8, device=codes.device))).sum(-1, keepdim=True)
        out = (word >> (8 * torch.arange(bits, device=codes.device))) & 255
        return out.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] * bits // 8)
    per_byte = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per_byte):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: `[..., m]` uint8 -> `[..., m * 8 / bits]` uint8 codes."""
    mask = (1 << bits) - 1
    if 8 % bits:
        b = packed.to(torch.int64).reshape(*packed.shape[:-1], packed.shape[-1] // bits, bits)
        word = (b << (8 * torch.arange(bits, device=packed.device))).sum(-1, keepdim=True)
        codes = (word >> (bits * torch.arange(8, device=packed.device))) & mask
        return codes.to(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 8 // bits)
    per_byte = 8 // bits
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
