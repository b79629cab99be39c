"""Encoded runs of tokens for one cache layer: K and V of the same tokens, through one recipe."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.codecs import QTensor, get_codec
from kvstrata.methods import StoreRecipe


@dataclass
class Segment:
    """`length` encoded tokens, of which the first `skip` are hidden (dropped by a sliding window
    but still held because keys grouped per channel can only be freed a whole group at a time)."""

    keys: QTensor
    values: QTensor
    length: int
    skip: int = 0

    @property
    def visible(self) -> int:
        return self.length - self.skip

    def parts(self):
        yield from self.keys.parts.values()
        yield from self.values.parts.values()


def encode_segment(recipe: StoreRecipe, keys: torch.Tensor, values: torch.Tensor) -> Segment:
    """`keys, values: [batch, kv_heads, tokens, head_dim]` -> Segment (tokens % key_group == 0)."""
    codec = get_codec(recipe.codec)
    if recipe.key_axis == "channel":
        qk = codec.encode(keys.transpose(-1, -2).contiguous())
    else:
        qk = codec.encode(keys)
    return Segment(qk, codec.encode(values), keys.shape[-2])


def decode_segment(recipe: StoreRecipe, seg: Segment, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible tokens of `seg` as dense `[batch, kv_heads, visible, head_dim]` K and V."""
    k = seg.keys.dequantize(dtype)
    if recipe.key_axis == "channel":
        k = k.transpose(-1, -2)
    v = seg.values.dequantize(dtype)
    return k[..., seg.skip :, :], v[..., seg.skip :, :]


def drop_front(recipe: StoreRecipe, seg: Segment, n: int) -> Segment | None:
    """Hide the oldest `n` visible tokens; free what the layout allows. None when nothing is left."""
    if n >= seg.visible:
        return None
    skip = seg.skip + n
    group = recipe.key_group
    free = (skip // group) * group
    if free == 0:
        return Segment(seg.keys, seg.values, seg.length, skip)
    keys = _narrow(seg.keys, -1 if recipe.key_axis == "channel" else -2, free, group)
    values = _narrow(seg.values, -2, free, 1)
    return Segment(keys, values, seg.length - free, skip - free)


def _narrow(q: QTensor, token_dim: int, start: int, group: int) -> QTensor:
    """Drop the first `start` tokens of a QTensor along `token_dim` (a copy, so memory is freed).

    token_dim=-2: tokens are a leading dim of every part; token_dim=-1: tokens are the block axis,
    `group` tokens per block, so blocks are dropped.
    """
    parts = {}
    ndim = len(q.shape)
    for name, t in q.parts.items():
        if name == "tensor_scale":
            parts[name] = t
        elif token_dim == -2:
            parts[name] = t.narrow(ndim - 2, start, t.shape[ndim - 2] - start).clone()
        else:
            blocks = start // group
            parts[name] = t.narrow(ndim - 1, blocks, t.shape[ndim - 1] - blocks).clone()
    shape = list(q.shape)
    shape[token_dim] -= start
    return QTensor(q.spec, tuple(shape), q.dtype, parts)
