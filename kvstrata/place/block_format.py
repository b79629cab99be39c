"""The payload of a KV record: per layer, its tokens as the cache held them (`kvstrata.hf.held.Held`):
sink tokens, encoded segments (codes and scales as held), an optional full-precision tail, and
the key transforms' state the codes were encoded through.

Tensors (safetensors, no pickle): `L{i}.sink.k`, `L{i}.sink.v`, `L{i}.tail.k`, `L{i}.tail.v`,
`L{i}.s{j}.k.{part}`, `L{i}.s{j}.v.{part}`, `L{i}.state.{t}.{name}`. Metadata: one JSON
document under `kv` -- `{"format": FORMAT, "tokens": n, "layers": {i: {"transforms": [...],
"digest": ..., "segments": [{"length", "skip", "k": {"codec", "shape", "dtype"}, "v": ...}]}}}`.

Invariant: `unpack` returns a layer's parts only when every tensor is exactly what the layer's
recipe would hold for the shapes the record states (names, shapes and dtypes checked against what
the codecs and transforms produce for those shapes, the state's digest recomputed, the tokens
adding up); anything else raises `RecordError`, a counted miss. A record of another format
version never parses (`FORMAT`, and the envelope's version in `records`).
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

from kvstrata.codecs import QTensor, spec_of
from kvstrata.codecs.transform import Fitted, text_of
from kvstrata.hf.held import Held
from kvstrata.hf.segments import Segment
from kvstrata.methods import StoreRecipe
from kvstrata.place.records import RecordError

FORMAT = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _qmeta(q: QTensor) -> dict:
    return {"codec": spec_of(q.codec), "shape": list(q.shape), "dtype": str(q.dtype).removeprefix("torch.")}


def pack(layers: dict[int, Held], tokens: int | None = None) -> tuple[dict, dict[str, str]]:
    """Per-layer held parts (each of `tokens` positions, when given) -> record tensors and string
    metadata."""
    tensors: dict[str, torch.Tensor] = {}
    doc = {"format": FORMAT, "tokens": tokens, "layers": {}}
    for i, held in layers.items():
        entry = {"segments": [], "transforms": [], "digest": None}
        for name, pair in (("sink", held.sink), ("tail", held.tail)):
            if pair is not None:
                tensors[f"L{i}.{name}.k"], tensors[f"L{i}.{name}.v"] = pair
        for j, seg in enumerate(held.segments):
            entry["segments"].append({"length": seg.length, "skip": seg.skip, "k": _qmeta(seg.keys),
                                      "v": _qmeta(seg.values)})
            for tag, q in (("k", seg.keys), ("v", seg.values)):
                tensors.update({f"L{i}.s{j}.{tag}.{p}": t for p, t in q.parts.items()})
        if held.fitted is not None:
            entry["transforms"] = [text_of(t) for t in held.fitted.transforms]
            entry["digest"] = held.fitted.digest()
            for t, state in enumerate(held.fitted.states):
                tensors.update({f"L{i}.state.{t}.{name}": v for name, v in state.items()})
        doc["layers"][str(i)] = entry
    return tensors, {"kv": json.dumps(doc, separators=(",", ":"))}


@lru_cache(maxsize=256)
def _parts(codec, last: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]:
    """(name, trailing shape, dtype, per token) of each part `codec` makes of a `[1, 1, 1, last]`
    tensor: parts of 3+ dims run along the tensor's leading dims, smaller ones are per tensor."""
    q = codec.encode(torch.zeros(1, 1, 1, last))
    return tuple((n, tuple(t.shape[3:] if t.dim() >= 3 else t.shape), t.dtype, t.dim() >= 3)
                 for n, t in q.parts.items())


def _check_parts(found: dict, want: tuple, lead: tuple[int, ...], where: str) -> None:
    """Exactly the parts `want` names, each of exactly the shape and dtype it should have."""
    names = {n for n, *_ in want}
    if set(found) != names:
        raise RecordError(f"{where}: parts {sorted(found)} where the codec makes {sorted(names)}")
    for name, trailing, dtype, per_token in want:
        t, shape = found[name], ((*lead, *trailing) if per_token else trailing)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RecordError(f"{where}.{name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")


def _qtensor(codec, meta: dict, parts: dict, h: int, d: int, channel: bool, dtype, most: int,
             where: str) -> QTensor:
    if meta.get("codec") != spec_of(codec) or DTYPES.get(meta.get("dtype")) != dtype:
        raise RecordError(f"{where}: codec {meta.get('codec')!r} / {meta.get('dtype')!r}, the recipe holds "
                          f"{spec_of(codec)!r} / {dtype}")
    shape = tuple(int(x) for x in meta["shape"])
    n = shape[-1] if len(shape) == 4 and channel else shape[-2] if len(shape) == 4 else 0
    if len(shape) != 4 or shape[:2] != (1, h) or shape[-2 if channel else -1] != d or not 1 <= n <= most:
        raise RecordError(f"{where}: shape {shape} does not fit [1, {h}, 1..{most} tokens, {d}]")
    _check_parts(parts, _parts(codec, shape[-1]), shape[:3], where)
    return QTensor(codec=codec, shape=shape, dtype=dtype, parts=parts)


def _raw(tensors: dict, key: str, h: int, d: int, dtype, rows: int | None, where: str):
    """The raw K, V pair under `key` (None when absent): `[1, h, n, d]` of `dtype`, with `rows` rows
    when given (0: there must be none)."""
    k, v = tensors.pop(f"{key}.k", None), tensors.pop(f"{key}.v", None)
    if k is None and v is None:
        if rows:
            raise RecordError(f"{where}: {rows} {key} rows missing")
        return None
    if k is None or v is None or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != (1, h) \
            or k.shape[-1] != d or k.dtype != dtype or v.dtype != dtype or k.shape[-2] == 0 \
            or (rows is not None and k.shape[-2] != rows):
        raise RecordError(f"{where}: {key} tensors do not fit [1, {h}, {rows or 'tokens'}, {d}] {dtype}")
    return k, v


def _fitted(recipe: StoreRecipe, entry: dict, tensors: dict, i: int, h: int, d: int) -> Fitted | None:
    """The layer's transform state, checked against what fitting the recipe's transforms makes, and
    by each transform (`Transform.check_state`: finite, in range)."""
    if entry["digest"] is None:
        return None
    if entry["transforms"] != [text_of(t) for t in recipe.transforms]:
        raise RecordError(f"layer {i}: transforms {entry['transforms']} are not the recipe's")
    probe = Fitted.fit(recipe.transforms, torch.zeros(1, h, 2, d))
    states = []
    for t, (transform, want) in enumerate(zip(recipe.transforms, probe.states)):
        got = {name: tensors.pop(f"L{i}.state.{t}.{name}", None) for name in want}
        for name, w in want.items():
            if got[name] is None or got[name].shape != w.shape or got[name].dtype != w.dtype:
                raise RecordError(f"layer {i}: transform state {name} missing or not "
                                  f"{tuple(w.shape)} {w.dtype}")
        try:
            transform.check_state(got, d)
        except ValueError as e:
            raise RecordError(f"layer {i}: {e}") from None
        states.append(got)
    fitted = Fitted(recipe.transforms, tuple(states))
    if fitted.digest() != entry["digest"]:
        raise RecordError(f"layer {i}: transform state does not match its digest")
    return fitted


def _layer(recipe: StoreRecipe, entry: dict, tensors: dict, i: int, h: int, d: int, dtype,
           span: tuple[int, int] | None) -> Held:
    """Layer `i`'s parts of a block of positions `span` ([lo, hi): its sink rows are the recipe's sink
    within it, no full-precision tail), or of a sliding window (None: no sink)."""
    lo, hi = span if span is not None else (0, 1 << 30)
    sink_rows = 0 if span is None else max(0, min(hi, recipe.sink) - lo)
    held = Held(sink=_raw(tensors, f"L{i}.sink", h, d, torch.bfloat16, sink_rows, f"layer {i}"),
                tail=_raw(tensors, f"L{i}.tail", h, d, dtype, 0 if span is not None else None, f"layer {i}"),
                fitted=_fitted(recipe, entry, tensors, i, h, d))
    if bool(entry["segments"]) != (held.fitted is not None):
        raise RecordError(f"layer {i}: encoded segments and transform state must come together")
    channel = recipe.key_axis == "channel"
    most = min(hi - lo, 1 << 20) + recipe.key_group  # a key group cut by the block held whole
    side_parts, kdt, vdt = (), dtype, dtype
    if held.fitted is not None:  # what the transforms store beside the key codes, and the dtypes they make
        z = torch.zeros(1, h, 1, d, dtype=dtype)
        k, v, side = held.fitted.forward(z, z)
        side_parts = tuple((n, tuple(t.shape[3:]), t.dtype, True) for n, t in side.items())
        kdt, vdt = k.dtype, v.dtype
    for j, s in enumerate(entry["segments"]):
        where = f"layer {i} segment {j}"
        length, skip = int(s["length"]), int(s["skip"])
        parts = {tag: {k.split(".", 3)[3]: tensors.pop(k) for k in [k for k in tensors
                                                                   if k.startswith(f"L{i}.s{j}.{tag}.")]}
                 for tag in ("k", "v")}
        side = {name: parts["k"].pop(name) for name in held.fitted.side if name in parts["k"]}
        keys = _qtensor(recipe.codec, s["k"], parts["k"], h, d, channel, kdt, most, where)
        values = _qtensor(recipe.value_codec, s["v"], parts["v"], h, d, False, vdt, most, where)
        _check_parts(side, side_parts, (1, h, length), where)  # beside the key codes
        keys.parts.update(side)
        n = keys.shape[-1] if channel else keys.shape[-2]
        if n != length or values.shape[-2] != length or not 0 <= skip < length:
            raise RecordError(f"{where}: length {length}, skip {skip} do not fit its {n} tokens")
        held.segments.append(Segment(keys=keys, values=values, length=length, skip=skip, fitted=held.fitted))
    return held


def unpack(recipes: dict[int, StoreRecipe], tensors: dict, meta: dict, *, kv_heads: int, head_dim: int,
           dtype: torch.dtype, start: int | None, tokens: int | None,
           shapes: dict[int, tuple[int, int]] | None = None) -> dict[int, Held]:
    """Record tensors + metadata -> each layer's held parts: layers exactly `recipes`' keys, holding
    positions [start, start + tokens) of full-attention layers, or (`start` None) a sliding window of
    any size; any inconsistency is a RecordError. `shapes`: (heads, dim) of layers not of
    `(kv_heads, head_dim)` (an encoder-decoder's `H(split)`)."""
    tensors = dict(tensors)
    span = None if start is None else (start, start + tokens)
    try:
        doc = json.loads(meta.get("kv", ""))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise RecordError(f"record format {doc.get('format') if isinstance(doc, dict) else None!r}, this "
                              f"build reads {FORMAT}")
        layers = doc["layers"]
        if sorted(layers, key=int) != [str(i) for i in sorted(recipes)]:
            raise RecordError(f"record holds layers {sorted(layers, key=int)}, expected {sorted(recipes)}")
        shape = {i: (shapes or {}).get(i, (kv_heads, head_dim)) for i in recipes}
        out = {i: _layer(recipes[i], layers[str(i)], tensors, i, *shape[i], dtype, span) for i in recipes}
        counts = {held.tokens for held in out.values()}
        if doc["tokens"] != tokens or (tokens is not None and counts != {tokens}):
            raise RecordError(f"record layers hold {sorted(counts)} tokens, expected {tokens}")
        if tensors:
            raise RecordError(f"record holds tensors no layer claims: {sorted(tensors)[:3]}")
    except RecordError:
        raise
    except Exception as exc:  # names, numbers or JSON that do not fit: the record is unusable
        raise RecordError(f"record does not decode: {type(exc).__name__}: {exc}") from None
    return out
