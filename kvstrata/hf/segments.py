"""Encoded runs of tokens for one cache layer: K and V of the same tokens, through one recipe.

A segment's tensors are views of buffers that may hold spare rows, so decode-time flushes append
in place (`append`) instead of creating a segment per token: a layer holds a handful of segments,
and decode attention walks them without copying. Spare rows are real memory and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.codecs import QTensor
from kvstrata.codecs.outliers import split_outliers
from kvstrata.codecs.rotation import rotate, unrotate
from kvstrata.methods import StoreRecipe

#: rows a segment made by a small (decode-time) flush reserves, so later flushes append in place
APPEND_ROWS = 64
#: hidden front tokens a sliding layer tolerates before it copies the rest to free them
COMPACT_ROWS = 64
#: a segment with spare rows takes its tensor scale (NVFP4) this many times above its first rows'
#: largest magnitude, so later rows up to that size still fit; block scales stay in E4M3's normal
#: range, where its relative precision does not depend on the magnitude
HEADROOM = 4.0


@dataclass
class Segment:
    """`length` encoded tokens, of which the first `skip` are hidden (dropped by a sliding window
    but still held until enough of them can be freed at once; keys grouped per channel are freed
    a whole group at a time). `keys` / `values` are exactly `length` tokens long; their parts are
    views of `buffers`, which may reserve room for more."""

    keys: QTensor
    values: QTensor
    length: int
    skip: int = 0
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def visible(self) -> int:
        return self.length - self.skip

    def parts(self):
        """Every tensor held (the whole buffers, spare rows included)."""
        for q, name in ((self.keys, "keys"), (self.values, "values")):
            yield from (self.buffers.get(name) or q.parts).values()


def _axes(recipe: StoreRecipe) -> tuple[int, int]:
    """Token axis of the K and V parts: 2 for `[b, h, tokens, ...]`; 3 for keys grouped per channel,
    whose parts are `[b, h, head_dim, token_blocks, ...]`."""
    return (3 if recipe.key_axis == "channel" else 2), 2


def _prepare(recipe: StoreRecipe, keys: torch.Tensor, values: torch.Tensor, outliers: torch.Tensor | None):
    """What the codec encodes: K (outlier channels split off, then rotated; transposed when keys are
    grouped per channel) and V (rotated), plus the kept channels `[b, h, n, c]` or None."""
    kept = None
    if outliers is not None:
        keys, kept = split_outliers(keys, outliers, recipe.outlier_fmt)
    r = recipe.rotation(keys.shape[-1])
    keys, values = rotate(keys, r), rotate(values, r)
    kt = keys.transpose(-1, -2).contiguous() if recipe.key_axis == "channel" else keys
    return kt, values, kept


def encode_segment(recipe: StoreRecipe, keys: torch.Tensor, values: torch.Tensor,
                   reserve: int = 0, outliers: torch.Tensor | None = None) -> Segment:
    """`keys, values: [batch, kv_heads, tokens, head_dim]` -> Segment (a last key group short of
    `key_group` tokens is padded with its last token and held whole; it takes no appends);
    `reserve` spare tokens are allocated for later `append`s; `outliers: [b, h, c]` key channels are
    kept apart in the recipe's `ofmt` (the keys' `outliers` part)."""
    kt, values, kept = _prepare(recipe, keys, values, outliers)
    encoded = []
    for codec, x in ((recipe.codec, kt), (recipe.value_codec, values)):
        if reserve and hasattr(codec, "fits"):
            encoded.append(codec.encode(x, codec.scale_for(x.abs().amax() * HEADROOM)))
        else:
            encoded.append(codec.encode(x))
    seg = Segment(*encoded, keys.shape[-2])
    if kept is not None:
        seg.keys.parts["outliers"] = kept
    if reserve:
        _reserve(recipe, seg, reserve)
    return seg


def probe_segment(recipe: StoreRecipe, kv_heads: int, head_dim: int, tokens: int = 256) -> Segment:
    """`tokens` zero tokens encoded with `recipe` (outlier channels included), for counting bytes."""
    z = torch.zeros(1, kv_heads, tokens, head_dim)
    idx = torch.arange(recipe.outliers).expand(1, kv_heads, -1) if recipe.outliers else None
    return encode_segment(recipe, z, z, outliers=idx)


def append(recipe: StoreRecipe, seg: Segment, keys: torch.Tensor, values: torch.Tensor,
           outliers: torch.Tensor | None = None) -> bool:
    """Encode `keys, values: [b, h, n, d]` into `seg`'s spare rows; False (nothing written) when
    there is no room or the rows cannot share the segment's scales (NVFP4's tensor scale)."""
    n = keys.shape[-2]
    if not seg.buffers or n == 0:
        return False
    group = recipe.key_group
    kax, vax = _axes(recipe)
    kcap = next(iter(seg.buffers["keys"].values())).shape[kax] * (group if kax == 3 else 1)
    if seg.length + n > kcap or seg.length % group:
        return False
    kt, values, kept = _prepare(recipe, keys, values, outliers)
    scales = [q.parts.get("tensor_scale") for q in (seg.keys, seg.values)]
    new = []
    for codec, x, held in zip((recipe.codec, recipe.value_codec), (kt, values), scales):
        if held is None:
            new.append(codec.encode(x))
        elif not codec.fits(x, held):
            return False
        else:
            new.append(codec.encode(x, held))
    if kept is not None:
        new[0].parts["outliers"] = kept
    start = seg.length
    for name, q, ax, unit in (("keys", new[0], kax, group if kax == 3 else 1), ("values", new[1], vax, 1)):
        for part, t in q.parts.items():
            if part != "tensor_scale":
                seg.buffers[name][part].narrow(ax, start // unit, t.shape[ax]).copy_(t)
    seg.length += n
    _views(recipe, seg)
    return True


def shrink(seg: Segment) -> None:
    """Give back `seg`'s spare rows (its parts become exact copies); no more appends into it."""
    if not seg.buffers:
        return
    for q in (seg.keys, seg.values):
        q.parts = {p: (t if p == "tensor_scale" else t.clone()) for p, t in q.parts.items()}
    seg.buffers = {}


def _reserve(recipe: StoreRecipe, seg: Segment, extra: int) -> None:
    """Move `seg`'s parts into buffers with room for `extra` more tokens."""
    group = recipe.key_group
    kax, vax = _axes(recipe)
    for name, q, ax, unit in (("keys", seg.keys, kax, group if kax == 3 else 1),
                              ("values", seg.values, vax, 1)):
        bufs = {}
        for part, t in q.parts.items():
            if part == "tensor_scale":
                bufs[part] = t
                continue
            shape = list(t.shape)
            shape[ax] += -(-extra // unit)
            buf = t.new_zeros(shape)
            buf.narrow(ax, 0, t.shape[ax]).copy_(t)
            bufs[part] = buf
        seg.buffers[name] = bufs
    _views(recipe, seg)


def _views(recipe: StoreRecipe, seg: Segment) -> None:
    """Point `seg.keys` / `seg.values` at the first `length` tokens of their buffers."""
    group = recipe.key_group
    kax, vax = _axes(recipe)
    for name, ax, unit in (("keys", kax, group if kax == 3 else 1), ("values", vax, 1)):
        q = getattr(seg, name)
        rows = seg.length // unit
        parts = {
            p: (t if p == "tensor_scale" else t.narrow(ax, 0, rows)) for p, t in seg.buffers[name].items()
        }
        shape = list(q.shape)
        shape[-1 if (name == "keys" and kax == 3) else -2] = seg.length
        setattr(seg, name, QTensor(q.codec, tuple(shape), q.dtype, parts))


def decode_segment(
    recipe: StoreRecipe, seg: Segment, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible tokens of `seg` as dense `[batch, kv_heads, visible, head_dim]` K and V (a store
    record's segment: no smoothing or outlier channels; a cache layer reads through its view)."""
    k = recipe.codec.decode(seg.keys).to(dtype)
    if recipe.key_axis == "channel":
        k = k.transpose(-1, -2)
    v = recipe.value_codec.decode(seg.values).to(dtype)
    r = recipe.rotation(k.shape[-1])
    k, v = unrotate(k, r), unrotate(v, r)
    return k[..., seg.skip :, :], v[..., seg.skip :, :]


def drop_front(recipe: StoreRecipe, seg: Segment, n: int, compact: int = 0) -> Segment | None:
    """Hide the oldest `n` visible tokens; None when nothing is left. Hidden tokens are freed (the
    rest copied) once at least `compact` of them can go; the layout frees whole key groups only."""
    if n >= seg.visible:
        return None
    skip = seg.skip + n
    group = recipe.key_group
    free = (skip // group) * group
    if free == 0 or free < compact:
        return Segment(seg.keys, seg.values, seg.length, skip, seg.buffers)
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
    return QTensor(q.codec, tuple(shape), q.dtype, parts)
