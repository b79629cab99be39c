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
def _parts(codec, last: int) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """(name, trailing shape, dtype) of each part `codec` makes of a `[1, 1, 1, last]` tensor."""
    q = codec.encode(torch.zeros(1, 1, 1, last))  # parts of fewer than 3 dims are per tensor: shape kept
    return tuple((n, tuple(t.shape[3:] if t.dim() >= 3 else t.shape), t.dtype) for n, t in q.parts.items())


def _check_parts(found: dict, want: tuple, lead: tuple[int, ...], where: str) -> None:
    names = {n for n, _, _ in want}
    if set(found) != names:
        raise RecordError(f"{where}: parts {sorted(found)} where the codec makes {sorted(names)}")
    for name, trailing, dtype in want:
        t = found[name]
        shape = (*lead, *trailing) if t.dim() >= 3 else trailing
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RecordError(f"{where}.{name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")


def _qtensor(codec, meta: dict, parts: dict, h: int, d: int, channel: bool, dtype, where: str) -> QTensor:
    if meta.get("codec") != spec_of(codec) or DTYPES.get(meta.get("dtype")) != dtype:
        raise RecordError(f"{where}: codec {meta.get('codec')!r} / {meta.get('dtype')!r}, the recipe holds "
                          f"{spec_of(codec)!r} / {dtype}")
    shape = tuple(int(x) for x in meta["shape"])
    n = shape[-1] if channel else shape[-2]
    if len(shape) != 4 or shape[:2] != (1, h) or shape[-2 if channel else -1] != d or n < 1:
        raise RecordError(f"{where}: shape {shape} does not fit [1, {h}, tokens, {d}]")
    lead = shape[:3]
    _check_parts(parts, _parts(codec, shape[-1]), lead, where)
    return QTensor(codec=codec, shape=shape, dtype=dtype, parts=parts)


def _raw(tensors: dict, key: str, h: int, d: int, dtype, where: str):
    k, v = tensors.pop(f"{key}.k", None), tensors.pop(f"{key}.v", None)
    if k is None and v is None:
        return None
    if k is None or v is None or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != (1, h) \
            or k.shape[-1] != d or k.dtype != dtype or v.dtype != dtype:
        raise RecordError(f"{where}: {key} tensors do not fit [1, {h}, tokens, {d}] {dtype}")
    return k, v


def _fitted(recipe: StoreRecipe, entry: dict, tensors: dict, i: int, h: int, d: int) -> Fitted | None:
    """The layer's transform state, checked against what fitting the recipe's transforms makes."""
    if entry["digest"] is None:
        return None
    if entry["transforms"] != [text_of(t) for t in recipe.transforms]:
        raise RecordError(f"layer {i}: transforms {entry['transforms']} are not the recipe's")
    probe = Fitted.fit(recipe.transforms, torch.zeros(1, h, 2, d))
    states = []
    for t, want in enumerate(probe.states):
        got = {name: tensors.pop(f"L{i}.state.{t}.{name}", None) for name in want}
        for name, w in want.items():
            if got[name] is None or got[name].shape != w.shape or got[name].dtype != w.dtype:
                raise RecordError(f"layer {i}: transform state {name} missing or not "
                                  f"{tuple(w.shape)} {w.dtype}")
        states.append(got)
    fitted = Fitted(recipe.transforms, tuple(states))
    if fitted.digest() != entry["digest"]:
        raise RecordError(f"layer {i}: transform state does not match its digest")
    z = torch.zeros(1, h, 1, d)
    k, _, side = fitted.forward(z, z)  # a state that cannot be applied (an index out of range) fails here
    fitted.inverse_keys(k, side)
    return fitted


def _layer(recipe: StoreRecipe, entry: dict, tensors: dict, i: int, h: int, d: int, dtype) -> Held:
    held = Held(sink=_raw(tensors, f"L{i}.sink", h, d, torch.bfloat16, f"layer {i}"),
                tail=_raw(tensors, f"L{i}.tail", h, d, dtype, f"layer {i}"),
                fitted=_fitted(recipe, entry, tensors, i, h, d))
    if held.sink is not None and held.sink[0].shape[-2] > recipe.sink:
        raise RecordError(f"layer {i}: {held.sink[0].shape[-2]} sink tokens, the recipe keeps {recipe.sink}")
    if bool(entry["segments"]) != (held.fitted is not None):
        raise RecordError(f"layer {i}: encoded segments and transform state must come together")
    channel = recipe.key_axis == "channel"
    side_parts = ()
    if held.fitted is not None:  # what the transforms store beside the key codes, per token
        z = torch.zeros(1, h, 1, d)
        side_parts = tuple((n, tuple(t.shape[3:]), t.dtype) for n, t in held.fitted.forward(z, z)[2].items())
    for j, s in enumerate(entry["segments"]):
        where = f"layer {i} segment {j}"
        parts = {tag: {k.split(".", 3)[3]: tensors.pop(k) for k in [k for k in tensors
                                                                   if k.startswith(f"L{i}.s{j}.{tag}.")]}
                 for tag in ("k", "v")}
        side = {name: parts["k"].pop(name) for name in held.fitted.side if name in parts["k"]}
        _check_parts(side, side_parts, (1, h, int(s["length"])), where)  # beside the key codes
        keys = _qtensor(recipe.codec, s["k"], parts["k"], h, d, channel, dtype, where)
        keys.parts.update(side)
        values = _qtensor(recipe.value_codec, s["v"], parts["v"], h, d, False, dtype, where)
        length, skip = int(s["length"]), int(s["skip"])
        n = keys.shape[-1] if channel else keys.shape[-2]
        if n != length or values.shape[-2] != length or not 0 <= skip < length:
            raise RecordError(f"{where}: length {length}, skip {skip} do not fit its {n} tokens")
        seg = Segment(keys=keys, values=values, length=length, skip=skip, fitted=held.fitted)
        held.segments.append(seg)
    return held


def unpack(recipes: dict[int, StoreRecipe], tensors: dict, meta: dict, kv_heads: int, head_dim: int,
           dtype: torch.dtype, tokens: int | None) -> dict[int, Held]:
    """Record tensors + metadata -> each layer's held parts (layers exactly `recipes`' keys, each
    holding `tokens` positions, or any number when None: a window); any inconsistency is a
    RecordError."""
    tensors = dict(tensors)
    try:
        doc = json.loads(meta.get("kv", ""))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise RecordError(f"record format {doc.get('format') if isinstance(doc, dict) else None!r}, this "
                              f"build reads {FORMAT}")
        layers = doc["layers"]
        if sorted(layers, key=int) != [str(i) for i in sorted(recipes)]:
            raise RecordError(f"record holds layers {sorted(layers, key=int)}, expected {sorted(recipes)}")
        out = {i: _layer(recipes[i], layers[str(i)], tensors, i, kv_heads, head_dim, dtype) for i in recipes}
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
