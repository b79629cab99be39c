"""Method specs: strings users type (`nvfp4:r=64`, `int2:group=32,r=128`, `nvfp4;sliding=fp8`,
`layers[0-3]=fp8;layers[4-29]=int2:rot=hadamard`), parsed once into config objects and rendered
back (`render`) where text leaves the process.

Grammar::

    spec      := chunk (";" chunk)*
    chunk     := recipe | class "=" recipe | "layers[" ranges "]" "=" recipe
    ranges    := (i | i "-" j) ("," (i | i "-" j))*          decoder layer indices, 0-based
    recipe    := component ("+" component)*
    component := name [":" key=value ("," key=value)*]

A bare recipe (first chunk only) applies to every layer (`bf16` when absent); `full=` / `sliding=`
override one class of layers (V4.1 keeps global KV in FP4 and sliding-window KV in FP8:
`nvfp4;sliding=fp8`); `layers[...]=` overrides the layers listed and wins over both (what
`kvstrata tune` emits). One registry (`kvstrata.registry`) resolves names. A store component's
parameters are its codec's fields plus the recipe knobs: the recipe's own (`RECIPE_KNOBS` below)
and every registered key transform's (`kvstrata.codecs.transform`), each declared once.
Invariant: `parse_method(render(spec)) == spec` for every parsed spec.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from types import MappingProxyType

from kvstrata import registry
from kvstrata.codecs import BF16, Codec, build, coerce_params, spec_of, split_spec
from kvstrata.codecs.blocks import FITS
from kvstrata.codecs.transform import DEPTH, Transform
from kvstrata.keep import KeepPolicy
from kvstrata.knobs import Knob, choice, field_knobs, integer, parse_ranges, ranges_text
from kvstrata.read import TopK
from kvstrata.registry import REGISTRY

LAYER_CLASSES = ("full", "sliding")
MAX_RECENT = 1 << 24  # r: recent tokens kept in full precision (beyond any context we run)
MAX_SINK = 1024  # sink: the oldest tokens kept in bf16
METHODS = REGISTRY  # name -> registry Entry (stratum, config class, defaults, tolerance)


@dataclass(frozen=True)
class StoreRecipe:
    """How one class of layers stores K/V: config instances, resolved once when the spec is parsed.

    codec: the element codec (the keys'; `vcodec` the values' when `v=` names another); r: most
    recent tokens kept in full precision (KIVI residual, 0 allowed); key_axis: "token" (scales per
    token, along head_dim) or "channel" (KIVI keys: groups run along tokens, so tokens are encoded
    `group` at a time); sink: the oldest tokens of full-attention layers kept in bf16;
    transforms: the key transforms applied before encoding (in pipeline order); keep: the keep
    policy applied to the context after prefill; depth: the depth-sharing codec (FreqDepthKV,
    MiniCache) for groups of adjacent layers; read: the top-k sparse decode-read config.
    """

    codec: Codec = BF16()
    r: int = 0
    key_axis: str = "token"
    sink: int = 0
    vcodec: Codec | None = None
    transforms: tuple[Transform, ...] = ()
    keep: KeepPolicy | None = None
    depth: object | None = None
    read: TopK | None = None

    @property
    def value_codec(self) -> Codec:
        """The codec values are encoded with (the keys' unless `v=` names another)."""
        return self.vcodec or self.codec

    @cached_property
    def key_group(self) -> int:
        """Tokens encoded together for keys (1 unless keys are grouped per channel)."""
        return getattr(self.codec, "group", 1) if self.key_axis == "channel" else 1

    def transform(self, cls: type) -> Transform | None:
        """The recipe's transform of class `cls`, or None."""
        return next((t for t in self.transforms if isinstance(t, cls)), None)


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method: one recipe per layer class, and per-layer overrides (`layers[...]=`).
    `text` is what the user wrote (kept for output); equality is by the recipes."""

    text: str = field(compare=False)
    full: StoreRecipe
    sliding: StoreRecipe
    layers: tuple[tuple[frozenset[int], StoreRecipe], ...] = ()

    def recipe(self, layer_class: str, index: int | None = None) -> StoreRecipe:
        """The recipe of decoder layer `index` (of class `layer_class`)."""
        for members, recipe in self.layers:
            if index in members:
                return recipe
        return self.sliding if layer_class == "sliding" else self.full

    def recipes(self) -> list[StoreRecipe]:
        """Every recipe the spec names (class recipes first)."""
        return [self.full, self.sliding] + [r for _, r in self.layers]

    def max_layer(self) -> int:
        """The highest layer index an override names (-1 without overrides)."""
        return max((max(m) for m, _ in self.layers), default=-1)

    def __str__(self) -> str:
        return self.text


# --- what does not combine: the one place ---------------------------------------------------------
#: conditions a knob may exclude: name -> (what the message calls it, whether a recipe meets it)
CONDITIONS: dict[str, tuple[str, Callable[[StoreRecipe], bool]]] = {
    "depth": ("depth sharing", lambda rec: rec.depth is not None),
    "keys=channel": ("keys=channel", lambda rec: rec.key_axis == "channel"),
}
#: whole-model strata a per-layer recipe (`layers[...]=`) cannot take
WHOLE_MODEL = "depth sharing and top-k reads apply to the whole model, not to listed layers"
#: what the persistent store cannot hold, and why
STORE_EXCLUDES = MappingProxyType({
    "keep": "the persistent store keeps every token: keep policies do not apply there",
    "depth": "depth-shared blocks span a group of layers and are encoded in blocks of their own, not at "
             "the store's block boundaries: the persistent store does not hold them",
})


def storable(spec: MethodSpec) -> bool:
    """Whether the persistent store can hold `spec`'s KV (`check_store` says why not)."""
    return all(getattr(rec, stratum) is None for rec in spec.recipes() for stratum in STORE_EXCLUDES)


def check_store(spec: MethodSpec) -> None:
    """Refuse a spec the persistent store cannot hold (`STORE_EXCLUDES`)."""
    for rec in spec.recipes():
        for stratum, why in STORE_EXCLUDES.items():
            if getattr(rec, stratum) is not None:
                raise ValueError(f"{spec.text!r}: {why}")


# --- the recipe's own knobs -------------------------------------------------------------------------
def _store_codec(text: str) -> str:
    entry = REGISTRY.get(text.lower())
    if entry is None or entry.stratum != "store":
        known = ", ".join(n for n, e in REGISTRY.items() if e.stratum == "store")
        raise ValueError(f"must name a store codec for the values ({known}), got {text!r}")
    return text.lower()


def _group_default(cls: type) -> int | None:
    return next((f.default for f in dataclasses.fields(cls) if f.name == "group"), None)


def _fit(rec: StoreRecipe) -> str:
    """The one `fit` of every codec of the recipe that has one (a mix cannot be written)."""
    fits = {c.fit for c in (rec.codec, rec.vcodec) if c is not None and hasattr(c, "fit")}
    if len(fits) > 1:
        raise ValueError(f"keys fit {rec.codec.fit!r} and values fit {rec.vcodec.fit!r} cannot be written "
                         "as one spec (fit= applies to both)")
    return fits.pop() if fits else "minmax"


@dataclass(frozen=True)
class RecipeKnob:
    """A knob of the store recipe itself: its declaration, and how to read it off a recipe (None: the
    recipe does not write it) with its default for a codec's registry entry."""

    knob: Knob
    get: Callable[[StoreRecipe], object]
    default: Callable[[object], object]


RECIPE_KNOBS: tuple[RecipeKnob, ...] = (
    RecipeKnob(Knob("r", "the newest r tokens stay in full precision (KIVI's residual; int codecs default to "
                    "128)", f"[0, {MAX_RECENT}]", integer(0, MAX_RECENT), position=10),
               lambda rec: rec.r, lambda entry: entry.defaults.get("r", 0)),
    RecipeKnob(Knob("keys", "token: key scales per token; channel: KIVI's keys, grouped per channel along "
                    "tokens (integer codecs; the prefill is encoded whole, its last group ragged, later "
                    "tokens wait in full precision for a whole group)", "token, channel",
                    choice("token", "channel"), position=20),
               lambda rec: rec.key_axis, lambda entry: entry.defaults.get("keys", "token")),
    RecipeKnob(Knob("sink", "the first N tokens of full-attention layers stay in bf16 beside the codes, "
                    "counted (attention sinks take much of every query's weight); sliding layers hold none",
                    f"[0, {MAX_SINK}]", integer(0, MAX_SINK), position=60,
                    excludes=MappingProxyType({"depth": DEPTH})),
               lambda rec: rec.sink, lambda entry: 0),
    RecipeKnob(Knob("v", "the values' codec (its default parameters) when it differs from the keys' "
                    "(`int2:r=32,v=nvfp4`: KIVI INT2 keys, NVFP4 values)", "a store codec", _store_codec,
                    position=80, excludes=MappingProxyType({"depth": DEPTH})),
               lambda rec: rec.vcodec.name if rec.vcodec is not None else None, lambda entry: None),
    RecipeKnob(Knob("vgroup", "the values' group with v=int4 / int3 / int2, per token along head_dim "
                    "(`v=int4,vgroup=64` is 4.5 bits on a 64-dim head)", "a group the values' codec takes",
                    str, position=81, needs="v"),
               lambda rec: getattr(rec.vcodec, "group", None) if rec.vcodec is not None else None,
               lambda entry: None),
    RecipeKnob(Knob("fit", "lsq: scales chosen for least squared error (INT groups refit by least squares, "
                    "NVFP4 blocks map their largest magnitude to 6, 5 or 4); same format and bytes, slower "
                    "encoding; every codec of the recipe that has a fit gets it", ", ".join(FITS),
                    choice(*FITS), position=90),
               _fit, lambda entry: "minmax"),
)


def transform_knobs() -> list[tuple[type, Knob]]:
    """(transform class, knob) for every registered key transform, in pipeline order; a transform's
    switch (its first knob) carries what the transform excludes."""
    return [(cls, replace(k, excludes=cls.excludes) if i == 0 else k)
            for cls in registry.TRANSFORMS for i, (_, k) in enumerate(field_knobs(cls))]


def knob_table() -> list[tuple[Knob, type | None]]:
    """Every recipe knob with the transform class that declares it (None: the recipe's own), by
    position."""
    rows = [(rk.knob, None) for rk in RECIPE_KNOBS] + [(k, cls) for cls, k in transform_knobs()]
    return sorted(rows, key=lambda row: row[0].position)


def _value(where: str, k: Knob, raw: str):
    try:
        return k.parse(raw)
    except ValueError as e:
        raise ValueError(f"{where}: parameter {k.key} {e}") from None


def _parse_component(text: str):
    """A store component -> StoreRecipe; a keep / depth / read component -> (stratum, instance)."""
    name, params = split_spec(text)
    if not name:
        raise ValueError(f"empty method name in {text!r}")
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r} in {text!r} (known: {', '.join(REGISTRY)})")
    entry = REGISTRY[name]
    if entry.stratum != "store":
        return (entry.stratum, build(text, entry.stratum))
    own = {rk.knob.key: _value(name, rk.knob, params.pop(rk.knob.key))
           for rk in RECIPE_KNOBS if rk.knob.key in params}
    transforms = []
    for cls in registry.TRANSFORMS:
        given = {f.name: (k, params.pop(k.key)) for f, k in field_knobs(cls) if k.key in params}
        if not given:
            continue
        t = cls(**{f: _value(name, k, raw) for f, (k, raw) in given.items()})
        for f, k in field_knobs(cls)[1:]:  # a knob set off its default while its switch is off
            if k.needs and f.name in given and not t.active and getattr(t, f.name) != f.default:
                raise ValueError(f"{name}: parameter {k.key}={given[f.name][1]} needs {k.needs} (it has no "
                                 "effect without it)")
        if t.active:
            transforms.append(t)
    for rk in RECIPE_KNOBS:
        if rk.knob.needs and rk.knob.key in own and rk.knob.needs not in own:
            raise ValueError(f"{name}: parameter {rk.knob.key}={rk.knob.render(own[rk.knob.key])} needs "
                             f"{rk.knob.needs} (it has no effect without it)")
    codec = entry.cls(**coerce_params(entry.cls, params, f"method {name}"))
    vcodec = None if "v" not in own else _value_codec(name, own["v"], own.get("vgroup"))
    if "fit" in own:  # one fit for every code of the recipe that has one (keys', values')
        fitted = [c for c in (codec, vcodec) if c is not None and hasattr(c, "fit")]
        if not fitted:
            raise ValueError(f"{name}: parameter fit applies to int4, int3, int2 and nvfp4 codes; "
                             "this recipe has none")
        codec, vcodec = (replace(c, fit=own["fit"]) if c in fitted else c for c in (codec, vcodec))
    keys = own.get("keys", entry.defaults.get("keys", "token"))
    if keys == "channel" and not hasattr(codec, "group"):
        raise ValueError(f"{name}: keys=channel needs a grouped integer codec")
    return StoreRecipe(codec, own.get("r", entry.defaults.get("r", 0)), keys, own.get("sink", 0), vcodec,
                       tuple(transforms))


def _value_codec(name: str, vname: str, vgroup: str | None) -> Codec:
    """The codec `v=<name>` gives the values: its default parameters, its group `vgroup=` if given."""
    cls = REGISTRY[vname].cls
    if vgroup is None:
        return cls()
    if _group_default(cls) is None:
        raise ValueError(f"{name}: parameter vgroup needs a grouped values codec (int4, int3, int2), "
                         f"got v={vname}")
    return cls(**coerce_params(cls, {"group": vgroup}, f"method {name} (vgroup)"))


def _check_combinations(rec: StoreRecipe, text: str) -> None:
    """Every knob set against what it excludes (`Knob.excludes`, conditions in `CONDITIONS`)."""
    entry = REGISTRY[rec.codec.name]
    set_knobs = [(rk.knob, rk.get(rec)) for rk in RECIPE_KNOBS
                 if rk.knob.excludes and rk.get(rec) != rk.default(entry)]
    for t in rec.transforms:
        f, k = field_knobs(type(t))[0]
        excludes = dict(type(t).excludes)
        if t.side:  # side parts ride per token beside the key codes: keys grouped per channel have none
            excludes.setdefault("keys=channel", "its side parts are stored per token beside the key codes")
        set_knobs.append((replace(k, excludes=excludes), getattr(t, f.name)))
    for k, value in set_knobs:
        for condition, why in k.excludes.items():
            what, holds = CONDITIONS[condition]
            if holds(rec):
                raise ValueError(f"{text!r}: {k.key}={k.render(value)} does not combine with {what}: {why}")


def _parse_recipe(text: str) -> StoreRecipe:
    parts = [p.strip() for p in text.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"empty component in {text!r}")
    parsed = [_parse_component(p) for p in parts]
    stores = [r for r in parsed if isinstance(r, StoreRecipe)]
    keeps, depths, reads = ([r[1] for r in parsed if isinstance(r, tuple) and r[0] == s]
                            for s in ("keep", "depth", "read"))
    for what, found in (
        ("element codecs", stores), ("keep policies", keeps), ("depth-sharing methods", depths),
        ("read methods", reads),
    ):
        if len(found) > 1:
            raise ValueError(f"{text!r} combines {len(found)} {what}; a recipe takes at most one")
    store = stores[0] if stores else StoreRecipe()
    recipe = replace(store, keep=keeps[0] if keeps else None, depth=depths[0] if depths else None,
                     read=reads[0] if reads else None)
    _check_combinations(recipe, text)
    if depths and recipe.key_axis == "channel":
        recipe = replace(recipe, key_axis="token")  # depth blocks group tokens themselves
    return recipe


def parse_method(text: str) -> MethodSpec:
    """Parse a method spec string; raises ValueError naming what is wrong. Specs are immutable, so
    each text is parsed once (per registry state) and the same MethodSpec is handed out again."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("method spec is empty")
    return _parse(text, registry.generation())


_LAYERS = re.compile(r"layers\[([^\]]*)\]\s*=(.*)", re.S)
_CLASS = re.compile(r"(full|sliding)\s*=(.*)", re.S | re.I)
MAX_LAYER = 4096  # beyond any model's depth: an index above it is a typo


def parse_layers(text: str) -> frozenset[int]:
    """`"0-3,7"` -> {0, 1, 2, 3, 7}; raises ValueError naming the bad item."""
    return frozenset(parse_ranges(text, f"layers[{text}]", "a layer index", MAX_LAYER))


@lru_cache(maxsize=1024)
def _parse(text: str, generation: int) -> MethodSpec:
    chunks = [c.strip() for c in text.split(";")]
    first = chunks[0]
    overrides = chunks
    base = StoreRecipe()
    if not (_LAYERS.fullmatch(first) or _CLASS.fullmatch(first)):
        base, overrides = _parse_recipe(first), chunks[1:]
    per_class = {"full": base, "sliding": base}
    layers: list[tuple[frozenset[int], StoreRecipe]] = []
    given: set[str] = set()
    for chunk in overrides:
        by_layer, by_class = _LAYERS.fullmatch(chunk), _CLASS.fullmatch(chunk)
        if by_layer:
            members = parse_layers(by_layer[1])
            taken = [i for m, _ in layers for i in sorted(m & members)]
            if taken:
                raise ValueError(f"{text.strip()!r}: layer {taken[0]} is assigned twice")
            recipe = _parse_recipe(by_layer[2])
            if recipe.depth is not None or recipe.read is not None:
                raise ValueError(f"{chunk!r}: {WHOLE_MODEL}")
            layers.append((members, recipe))
        elif by_class:
            cls = by_class[1].lower()
            if cls in given:
                raise ValueError(f"{text.strip()!r}: layer class {cls!r} given twice")
            given.add(cls)
            per_class[cls] = _parse_recipe(by_class[2])
        else:
            raise ValueError(f"{chunk!r}: expected <class>=<recipe> with class in {LAYER_CLASSES}, or "
                             "layers[i-j,...]=<recipe> (a recipe for every layer goes first)")
    spec = MethodSpec(text.strip(), per_class["full"], per_class["sliding"], tuple(layers))
    if layers and any(r.depth is not None for r in spec.recipes()):
        raise ValueError(f"{text.strip()!r}: depth sharing does not combine with per-layer assignments")
    return spec


# --- rendering: objects -> the text that parses back to them ---------------------------------------
def _codec_text(codec: Codec) -> str:
    """`spec_of(codec)` without `fit`, which the recipe writes once for all its codecs."""
    return spec_of(replace(codec, fit="minmax") if hasattr(codec, "fit") else codec)


def _check_values_codec(rec: StoreRecipe) -> None:
    """`v=` names a codec with its default parameters, `vgroup=` its group and `fit=` its fit."""
    v = rec.vcodec
    plain = replace(v, **{k: getattr(v.__class__(), k) for k in ("group", "fit") if hasattr(v, k)})
    if plain != v.__class__():
        raise ValueError(f"a values codec {spec_of(v)!r} cannot be written as v=<name> (default parameters "
                         "but its group and fit)")


def render_recipe(rec: StoreRecipe, explicit: tuple[str, ...] = ()) -> str:
    """The recipe as text that parses back equal; `explicit`: recipe knobs written even at their
    default (the tuner writes `r` and `keys` always)."""
    comps = [spec_of(c) for c in (rec.keep, rec.depth) if c is not None]
    knobs: list[tuple[int, str]] = []
    if rec.vcodec is not None:
        _check_values_codec(rec)
    entry = REGISTRY[rec.codec.name]
    for rk in RECIPE_KNOBS:
        value, default = rk.get(rec), rk.default(entry)
        if rk.knob.key == "vgroup" and rec.vcodec is not None:
            default = _group_default(type(rec.vcodec))
        if value is not None and (value != default or rk.knob.key in explicit):
            knobs.append((rk.knob.position, f"{rk.knob.key}={rk.knob.render(value)}"))
    for t in rec.transforms:
        for i, (f, k) in enumerate(field_knobs(type(t))):
            value = getattr(t, f.name)
            if i == 0 or value != f.default:  # the switch, then what is off its default
                knobs.append((k.position, f"{k.key}={k.render(value)}"))
    store = StoreRecipe(rec.codec, rec.r, rec.key_axis, rec.sink, rec.vcodec, rec.transforms)
    if knobs or store != StoreRecipe() or not comps:
        codec = _codec_text(rec.codec)
        params = [text for _, text in sorted(knobs, key=lambda x: x[0])]
        comps.append(codec + ((":" if ":" not in codec else ",") + ",".join(params) if params else ""))
    if rec.read is not None:
        comps.append(spec_of(rec.read))
    return "+".join(comps)


def render(spec: MethodSpec) -> str:
    """The spec as canonical text: `parse_method(render(spec)) == spec`."""
    text = render_recipe(spec.full)
    if spec.sliding != spec.full:
        text += f";sliding={render_recipe(spec.sliding)}"
    for members, rec in spec.layers:
        text += f";layers[{ranges_text(members)}]={render_recipe(rec)}"
    return text


__all__ = ["MethodSpec", "StoreRecipe", "check_store", "parse_method", "render", "render_recipe"]
