"""Where a token's K and V sit in an engine's paged KV tensor, found by asking the engine.

vLLM's page layout belongs to its attention backend and, on the CPU, to the instruction set the
kernel was built for (keys packed for AMX or AVX-512 tiles, the block axis first or second on a
GPU). Rather than hard-code any of it, `PageMap.probe` has the backend's own cache writer store
known values into one block and reads back where each (head, token, channel) of K and of V
landed. Gathering and scattering then index the cache's flat storage: exact (no arithmetic on
the values), one index tensor per layer shape, valid for every block because blocks are strided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: writes K, V `[tokens, kv_heads, head_dim]` into `cache` at flat slots `slots` (vLLM's
#: `impl.do_kv_cache_update(layer, k, v, cache, slot_mapping)`)
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """The engine's page layout is not one the probe can map (said at engine start, never guessed)."""


@dataclass(frozen=True)
class PageMap:
    """`keys[h, t, d]` / `values[h, t, d]`: offsets into the flat cache of token `t` of block 0;
    block `b` is `b * block_stride` further."""

    keys: torch.Tensor
    values: torch.Tensor
    block_stride: int
    block_size: int

    @classmethod
    def probe(cls, cache: torch.Tensor, write: Writer, num_blocks: int, block_size: int, kv_heads: int,
              head_dim: int) -> "PageMap":
        """Map `cache`'s layout by writing ids into its block 0 (restored afterwards). Ids stay exact in
        bf16 (at most 256), one probe per coordinate; K ids positive, V ids negative."""
        if not cache.is_contiguous():
            raise LayoutError(f"the KV cache tensor {tuple(cache.shape)} is not contiguous")
        axes = [a for a, n in enumerate(cache.shape) if n == num_blocks]
        if len(axes) != 1:
            raise LayoutError(f"cannot tell the block axis of a KV cache {tuple(cache.shape)} "
                              f"({num_blocks} blocks)")
        if max(block_size, kv_heads, head_dim) > 256:
            raise LayoutError("block size, KV heads and head size must each be <= 256 to probe exactly")
        block0 = cache.select(axes[0], 0)  # a view: every element of block 0, wherever it sits
        offsets = sum(torch.arange(n).view([-1 if i == a else 1 for i in range(block0.dim())]) * st
                      for a, (n, st) in enumerate(zip(block0.shape, block0.stride()))).flatten()
        saved = block0.clone()
        shape = (block_size, kv_heads, head_dim)
        grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")  # t, h, d
        slots = torch.arange(block_size, device=cache.device)
        found = []
        try:
            for coord in grids:
                ids = (coord + 1).to(cache.dtype).to(cache.device)
                block0.zero_()
                write(ids, -ids, cache, slots)
                found.append(block0.detach().cpu().float().flatten())
        finally:
            block0.copy_(saved)
        return cls(keys=_offsets(found, offsets, shape, 1.0), values=_offsets(found, offsets, shape, -1.0),
                   block_stride=cache.stride(axes[0]), block_size=block_size)

    def where(self, block_ids: list[int], first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices `[h, count, d]` of K and of V at positions [first, first + count) of a request
        whose blocks are `block_ids` (position p lives in block `block_ids[p // block_size]`); the
        same for every layer of one shape, so computed once per chunk."""
        pos = torch.arange(first, first + count)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        shift = (blocks * self.block_stride)[None, :, None]
        at = pos % self.block_size
        return self.keys[:, at, :] + shift, self.values[:, at, :] + shift

    @staticmethod
    def gather(cache: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]):
        """K, V `[h, n, d]` (copies, on the CPU) at `where`."""
        flat = cache.view(-1)
        return tuple(flat[idx.to(cache.device)].cpu() for idx in where)

    @staticmethod
    def scatter(cache: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor,
                v: torch.Tensor) -> None:
        """Write K, V `[h, n, d]` at `where`."""
        flat = cache.view(-1)
        for idx, x in zip(where, (k, v)):
            flat[idx.to(cache.device)] = x.to(device=cache.device, dtype=cache.dtype)


def _offsets(found: list[torch.Tensor], offsets: torch.Tensor, shape: tuple[int, int, int],
             sign: float) -> torch.Tensor:
    """Flat offsets `[h, t, d]` where the probes wrote (t + 1, h + 1, d + 1) with `sign` (`found[i][j]`:
    what probe i left at block-0 element j, whose flat offset is `offsets[j]`); every slot exactly once."""
    where = torch.nonzero(found[0] * sign > 0).flatten()
    block_size, heads, dim = shape
    if where.numel() != block_size * heads * dim:
        raise LayoutError(f"the probe wrote {where.numel()} slots, expected {block_size * heads * dim}")
    coords = [(f[where] * sign).round().long() - 1 for f in found]
    for c, n in zip(coords, shape):
        if c.min() < 0 or c.max() >= n:
            raise LayoutError("the probe's values came back changed: the cache does not store them exactly")
    out = torch.full((heads, block_size, dim), -1, dtype=torch.long)
    out[coords[1], coords[0], coords[2]] = offsets[where]
    if (out < 0).any():
        raise LayoutError("the probe did not find every (head, token, channel) of a block exactly once")
    return out
