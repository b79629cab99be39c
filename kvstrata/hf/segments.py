"""Encoded runs of tokens for one cache layer: K and V of the same tokens, through one recipe.

A segment's tensors are views of buffers that may hold spare rows, so decode-time flushes append
in place (`append`) instead of creating a segment per token: a layer holds a handful of segments,
and decode attention walks them without copying. Spare rows are real memory and are counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvstrata.codecs import QTensor
from kvstrata.codecs.base import SharedScale
from kvstrata.codecs.qtensor import held_bytes
from kvstrata.codecs.transform import IDENTITY, Fitted
from kvstrata.methods import StoreRecipe
from kvstrata.read.decode import decode_run, token_rows

#: rows a segment made by a small (decode-time) flush reserves, so later flushes append in place
APPEND_ROWS = 64
#: hidden front tokens a sliding layer tolerates before it copies the rest to free them
COMPACT_ROWS = 64
#: a segment with spare rows takes its tensor scale (NVFP4) this many times above its first rows'
#: largest magnitude, so later rows up to that size still fit; block scales stay in E4M3's normal
#: range, where its relative precision does not depend on the magnitude
HEADROOM = 4.0
#: tokens a long run is encoded at a time (rounded down to whole key groups)
ENCODE_CHUNK = 4096


@dataclass(kw_only=True)
class Segment:
    """`length` encoded tokens, of which the first `skip` are hidden (dropped by a sliding window
    but still held until enough of them can be freed at once; keys grouped per channel are freed
    a whole group at a time). `keys` / `values` are exactly `length` tokens long; their parts are
    views of `buffers`, which may reserve room for more. `fitted`: the key transforms the codes
    were encoded through, with their state (shared by every segment of a layer)."""

    keys: QTensor
    values: QTensor
    length: int
    skip: int = 0
    buffers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    fitted: Fitted = IDENTITY

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


def _prepare(recipe: StoreRecipe, fitted: Fitted, keys: torch.Tensor, values: torch.Tensor):
    """What the codecs encode: K and V through the key transforms (K transposed when keys are grouped
    per channel), and the transforms' side parts (`[b, h, n, ...]`, stored beside the key codes)."""
    keys, values, side = fitted.forward(keys, values)
    kt = keys.transpose(-1, -2).contiguous() if recipe.key_axis == "channel" else keys
    return kt, values, side


def encode_segment(recipe: StoreRecipe, keys: torch.Tensor, values: torch.Tensor, fitted: Fitted = IDENTITY,
                   reserve: int = 0) -> Segment:
    """`keys, values: [batch, kv_heads, tokens, head_dim]` -> Segment encoded through `fitted` (a last
    key group short of `key_group` tokens is padded with its last token and held whole; it takes no
    appends); `reserve` spare tokens are allocated for later `append`s. A long run is encoded
    `ENCODE_CHUNK` tokens at a time into the same codes (every codec encodes token by token or in
    whole key groups; a shared tensor scale is the whole run's), so the encoders' float32
    intermediates stay the size of a chunk, not of a 32k-token layer."""
    n = keys.shape[-2]
    step = max(recipe.key_group, ENCODE_CHUNK // recipe.key_group * recipe.key_group)
    spans = [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]
    codecs = (recipe.codec, recipe.value_codec)
    scales: list[torch.Tensor | None] = [None, None]
    for which, codec in enumerate(codecs):
        if isinstance(codec, SharedScale) and (reserve or len(spans) > 1):
            amax = max(_prepare(recipe, fitted, keys[..., a:b, :], values[..., a:b, :])[which].abs().amax()
                       for a, b in spans)
            scales[which] = codec.scale_for(amax * (HEADROOM if reserve else 1.0))
    pieces = []
    for a, b in spans:
        kt, v, side = _prepare(recipe, fitted, keys[..., a:b, :], values[..., a:b, :])
        enc = [codec.encode(x) if sc is None else codec.encode(x, sc)
               for codec, x, sc in zip(codecs, (kt, v), scales)]
        enc[0].parts.update(side)
        pieces.append((enc, set(side)))
    kax, vax = _axes(recipe)
    side = pieces[0][1]
    seg = Segment(keys=_joined([p[0][0] for p in pieces], kax, side),
                  values=_joined([p[0][1] for p in pieces], vax), length=n, fitted=fitted)
    if reserve:
        _reserve(recipe, seg, reserve)
    return seg


def _joined(pieces: list[QTensor], axis: int, side: set[str] = frozenset()) -> QTensor:
    """Consecutive token spans' encodings as one: parts joined along the token `axis` (the
    transforms' `side` parts along their own token axis, 2); one tensor scale, shared."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    parts = {name: t if name == "tensor_scale" else
             torch.cat([p.parts[name] for p in pieces], 2 if name in side else axis)
             for name, t in first.parts.items()}
    shape = list(first.shape)
    tokens = -1 if axis == 3 else -2  # keys grouped per channel are encoded transposed: tokens last
    shape[tokens] = sum(p.shape[tokens] for p in pieces)
    return QTensor(codec=first.codec, shape=tuple(shape), dtype=first.dtype, parts=parts)


def probe_segment(recipe: StoreRecipe, kv_heads: int, head_dim: int, tokens: int = 256) -> Segment:
    """`tokens` zero tokens encoded with `recipe` (transform side parts included), for counting bytes."""
    z = torch.zeros(1, kv_heads, tokens, head_dim)
    return encode_segment(recipe, z, z, Fitted.fit(recipe.transforms, z))


@functools.lru_cache(maxsize=256)
def probe_row_bytes(recipe: StoreRecipe, head_dim: int, tokens: int = 256) -> tuple[float, float]:
    """Bytes one token's K row and V row take per KV head under `recipe` (a probe of `tokens` zero
    tokens encoded once per recipe and head size: a read state asks per layer, at its first step)."""
    seg = probe_segment(recipe, 1, head_dim, tokens)
    return held_bytes(seg.keys.parts.values()) / tokens, held_bytes(seg.values.parts.values()) / tokens


def has_room(recipe: StoreRecipe, seg: Segment, n: int) -> bool:
    """Whether `n` more tokens can be appended into `seg`'s spare rows."""
    if not seg.buffers or n == 0:
        return False
    group = recipe.key_group
    kax, _ = _axes(recipe)
    kcap = next(iter(seg.buffers["keys"].values())).shape[kax] * (group if kax == 3 else 1)
    return seg.length + n <= kcap and seg.length % group == 0


def append(recipe: StoreRecipe, seg: Segment, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Encode `keys, values: [b, h, n, d]` into `seg`'s spare rows (through its transforms); False
    (nothing written) when there is no room or the rows cannot share the segment's scales (NVFP4's
    tensor scale)."""
    return append_many(recipe, [seg], [keys], [values])[0]


def append_many(recipe: StoreRecipe, segs: list[Segment], keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> list[bool]:
    """`append` for the segments of many sequences at once (a batched decode step: one token each,
    the same recipe), each codec called once over all of them: the codes equal those of one
    `append` per segment (every codec encodes row by row; NVFP4 gets each segment's tensor scale).
    Per segment, False: nothing written there (no room, or its rows do not fit its scales)."""
    n = keys[0].shape[-2]
    ok = [has_room(recipe, seg, k.shape[-2]) and k.shape[-2] == n for seg, k in zip(segs, keys)]
    prepared = {i: _prepare(recipe, segs[i].fitted, keys[i], values[i]) for i, good in enumerate(ok) if good}
    codecs = (recipe.codec, recipe.value_codec)
    for i, (kt, v, _) in prepared.items():
        for codec, x, q in zip(codecs, (kt, v), (segs[i].keys, segs[i].values)):
            held = q.parts.get("tensor_scale")
            ok[i] = ok[i] and (held is None or codec.fits(x, held))
    rows = [i for i in prepared if ok[i]]
    if not rows:
        return ok
    new = []
    for which, codec in enumerate(codecs):
        x = torch.cat([prepared[i][which] for i in rows], 0)
        held = [(segs[i].keys, segs[i].values)[which].parts.get("tensor_scale") for i in rows]
        scale = None if held[0] is None else torch.stack([h.reshape(()) for h in held]).reshape(-1, 1, 1, 1)
        new.append(codec.encode(x) if scale is None else codec.encode(x, scale))
    for r, i in enumerate(rows):
        row = [{part: t[r:r + 1] for part, t in q.parts.items() if part != "tensor_scale"} for q in new]
        row[0].update(prepared[i][2])
        _write(recipe, segs[i], row[0], row[1], n)
    return ok


def _write(recipe: StoreRecipe, seg: Segment, kparts: dict, vparts: dict, n: int) -> None:
    """Copy `n` encoded tokens' parts into `seg`'s spare rows and extend its views over them."""
    group = recipe.key_group
    kax, vax = _axes(recipe)
    start = seg.length
    keys = ("keys", kparts, kax, group if kax == 3 else 1)
    for name, parts, ax, unit in (keys, ("values", vparts, vax, 1)):
        for part, t in parts.items():
            seg.buffers[name][part].narrow(ax, start // unit, t.shape[ax]).copy_(t)
    seg.length += n
    _views(recipe, seg)


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
        setattr(seg, name, QTensor(codec=q.codec, shape=tuple(shape), dtype=q.dtype, parts=parts))


def decode_segment(
    recipe: StoreRecipe, seg: Segment, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible tokens of `seg` as dense `[batch, kv_heads, visible, head_dim]` K and V, its key
    transforms undone."""
    return decode_run((seg.keys, seg.values, seg.skip), recipe.key_axis == "channel", seg.fitted, dtype)


def drop_front(recipe: StoreRecipe, seg: Segment, n: int, compact: int = 0) -> Segment | None:
    """Hide the oldest `n` visible tokens; None when nothing is left. Hidden tokens are freed (the
    rest copied) once at least `compact` of them can go; the layout frees whole key groups only."""
    if n >= seg.visible:
        return None
    skip = seg.skip + n
    group = recipe.key_group
    free = (skip // group) * group
    if free == 0 or free < compact:
        return Segment(keys=seg.keys, values=seg.values, length=seg.length, skip=skip, buffers=seg.buffers,
                       fitted=seg.fitted)
    keys = _narrow(seg.keys, -1 if recipe.key_axis == "channel" else -2, free, group)
    values = _narrow(seg.values, -2, free, 1)
    return Segment(keys=keys, values=values, length=seg.length - free, skip=skip - free, fitted=seg.fitted)


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
    return QTensor(codec=q.codec, shape=tuple(shape), dtype=q.dtype, parts=parts)


def _blocks(q: QTensor, first: int, count: int, tokens: int) -> QTensor:
    """Token blocks [first, first + count) of channel-grouped keys `[b, h, d, tokens]` (parts
    `[b, h, d, blocks, ...]`), `tokens` of them in use; views, no copy."""
    parts = {name: (t if t.dim() < 3 else t.narrow(3, first, count)) for name, t in q.parts.items()}
    return QTensor(codec=q.codec, shape=(*q.shape[:3], tokens), dtype=q.dtype, parts=parts)


def cut_segment(recipe: StoreRecipe, seg: Segment, a: int, b: int) -> Segment:
    """Visible tokens [a, b) of `seg` as a segment of their own, its codes as held (views of `seg`'s
    parts, no copy). Keys grouped per channel keep the whole groups `a` and `b` fall in: the front
    of the first is hidden (`skip`), the back of the last lies beyond the new segment's length."""
    start, stop = seg.skip + a, seg.skip + b
    if recipe.key_axis != "channel":
        rows = (token_rows(seg.keys, start, stop), token_rows(seg.values, start, stop))
        return Segment(keys=rows[0], values=rows[1], length=b - a, fitted=seg.fitted)
    g = recipe.key_group
    first = start // g * g
    keys = _blocks(seg.keys, first // g, -(-stop // g) - first // g, stop - first)
    return Segment(keys=keys, values=token_rows(seg.values, first, stop), length=stop - first,
                   skip=start - first, fitted=seg.fitted)


def _overlap(recipe: StoreRecipe, a: Segment, b: Segment) -> int | None:
    """How many of `b`'s first tokens `a` already holds when `b` can continue `a`'s run (None when it
    cannot): `a` ends on a whole key group and `b` hides nothing (0), or -- keys grouped per channel,
    cut from one run at a point inside a group -- `a` ends `b.skip` tokens into the very group `b`
    starts with, whose codes both hold (`b.skip`). Both must hold the same parts under the same
    transforms and per-tensor scales."""
    if not a.fitted.same_as(b.fitted):
        return None
    for x, y in ((a.keys, b.keys), (a.values, b.values)):
        if x.parts.keys() != y.parts.keys() or x.codec != y.codec:
            return None
        for name in x.parts:
            p, r = x.parts[name], y.parts[name]
            if p.dtype != r.dtype or p.dim() != r.dim() or (p.dim() < 3 and not torch.equal(p, r)):
                return None  # parts of fewer than 3 dims are per tensor (a tensor scale): shared
    g, ragged = recipe.key_group, a.length % recipe.key_group
    if ragged == 0:
        return 0 if b.skip == 0 else None
    if b.skip != ragged:
        return None
    last, first = _blocks(a.keys, -(-a.length // g) - 1, 1, g), _blocks(b.keys, 0, 1, g)
    same = all(torch.equal(last.parts[n], first.parts[n]) for n in last.parts if last.parts[n].dim() >= 3)
    return ragged if same else None


def _cat(q: QTensor, more: list[QTensor], axis: int, drop: list[int], tokens: int, token_dim: int) -> QTensor:
    """`q` then each of `more` along the parts' token (or token-block) `axis`, the first `drop[i]`
    entries of `more[i]` left out; `tokens` in all along the shape's `token_dim`."""
    def rest(name: str) -> list[torch.Tensor]:
        return [m.parts[name].narrow(axis, d, m.parts[name].shape[axis] - d) for m, d in zip(more, drop)]

    parts = {name: (t if t.dim() < 3 else torch.cat([t] + rest(name), axis)) for name, t in q.parts.items()}
    shape = list(q.shape)
    shape[token_dim] = tokens
    return QTensor(codec=q.codec, shape=tuple(shape), dtype=q.dtype, parts=parts)


def join_segments(recipe: StoreRecipe, segs: list[Segment]) -> list[Segment]:
    """Adjacent segments that continue one run (`_overlap`) concatenated: a copy of their codes, no
    encode, so a layer rebuilt from many store records reads a few runs, not one per record."""
    out: list[list[tuple[Segment, int]]] = []
    for seg in segs:
        shared = _overlap(recipe, out[-1][-1][0], seg) if out else None
        if shared is None:
            out.append([(seg, 0)])
        else:
            out[-1].append((seg, shared))
    channel = recipe.key_axis == "channel"
    joined = []
    for group in out:
        (head, _), rest = group[0], group[1:]
        if not rest:
            joined.append(head)
            continue
        more, shared = [s for s, _ in rest], [n for _, n in rest]
        length = head.length + sum(s.length - n for s, n in rest)
        if channel:  # a key group both held is held once
            keys = _cat(head.keys, [s.keys for s in more], 3, [min(n, 1) for n in shared], length, -1)
        else:
            keys = _cat(head.keys, [s.keys for s in more], 2, shared, length, -2)
        values = _cat(head.values, [s.values for s in more], 2, shared, length, -2)
        joined.append(Segment(keys=keys, values=values, length=length, skip=head.skip, fitted=head.fitted))
    return joined
