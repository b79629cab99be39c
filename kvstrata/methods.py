"""Method specs: strings users type (`nvfp4:r=64`, `int2:group=32,r=128`, `nvfp4;sliding=fp8`,
`layers[0-3]=fp8;layers[4-29]=int2:rot=hadamard`).

Grammar::

    spec      := chunk (";" chunk)*
    chunk     := recipe | class "=" recipe | "layers[" ranges "]" "=" recipe
    ranges    := (i | i "-" j) ("," (i | i "-" j))*          decoder layer indices, 0-based
    recipe    := component ("+" component)*
    component := name [":" key=value ("," key=value)*]

A bare recipe (first chunk only) applies to every layer (`bf16` when absent); `full=` / `sliding=`
override one class of layers (V4.1 keeps global KV in FP4 and sliding-window KV in FP8:
`nvfp4;sliding=fp8`); `layers[...]=` overrides the layers listed and wins over both (what
`kvstrata tune` emits). One registry
(`kvstrata.registry`) resolves names; each entry says its stratum and its own parameters. A parsed
spec holds config instances; text is rendered back from them only at the edges (`spec_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from functools import cached_property, lru_cache

import torch

from kvstrata import registry
from kvstrata.codecs import BF16, Codec, build, coerce_params, split_spec
from kvstrata.codecs.outliers import KEPT_FORMATS
from kvstrata.codecs.rotation import hadamard_rotation
from kvstrata.keep import KeepPolicy
from kvstrata.read import TopK
from kvstrata.registry import REGISTRY

LAYER_CLASSES = ("full", "sliding")
MAX_RECENT = 1 << 24  # r: recent tokens kept in full precision (beyond any context we run)
MAX_SINK = 1024  # sink: the oldest tokens kept in bf16
METHODS = REGISTRY  # name -> registry Entry (stratum, config class, defaults, tolerance)


@dataclass(frozen=True)
class StoreRecipe:
    """How one class of layers stores K/V: config instances, resolved once when the spec is parsed.

    codec: the element codec; r: most recent tokens kept in full precision (KIVI residual, 0
    allowed); key_axis: "token" (scales per token, along head_dim) or "channel" (KIVI keys: groups
    run along tokens, so tokens are encoded `group` at a time); keep: the keep policy applied to
    the context after prefill; depth: the depth-sharing codec (FreqDepthKV, MiniCache) for groups
    of adjacent layers; read: the top-k sparse decode-read config.
    """

    codec: Codec = BF16()
    r: int = 0
    key_axis: str = "token"
    keep: KeepPolicy | None = None
    depth: object | None = None
    read: TopK | None = None
    rot: str = "none"  # "hadamard": K and V rotated along head_dim before encoding
    rot_seed: int = 0
    smooth: float = 0.0  # > 0: keys divided per channel by (prefill absmax)^smooth, the query multiplied
    center: bool = False  # keys less their per-channel prefill mean before encoding (added back on decode)
    sink: int = 0  # the first `sink` tokens of full-attention layers stay in bf16 (attention sinks)
    outliers: int = 0  # > 0: that many key channels per KV head kept apart (codecs.outliers)
    outlier_fmt: str = "bf16"  # what the kept channels are stored in (`ofmt=`: bf16 or fp8)
    vcodec: Codec | None = None  # the values' codec when it differs from the keys' (`v=<codec>`)

    @property
    def value_codec(self) -> Codec:
        """The codec values are encoded with (the keys' unless `v=` names another)."""
        return self.vcodec or self.codec

    def rotation(self, head_dim: int) -> torch.Tensor | None:
        """The rotation applied before encoding (`[head_dim, head_dim]`), or None."""
        return hadamard_rotation(head_dim, self.rot_seed) if self.rot == "hadamard" else None

    @cached_property
    def key_group(self) -> int:
        """Tokens encoded together for keys (1 unless keys are grouped per channel)."""
        return getattr(self.codec, "group", 1) if self.key_axis == "channel" else 1


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method: one recipe per layer class, and per-layer overrides (`layers[...]=`)."""

    text: str
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
    r = params.pop("r", str(entry.defaults.get("r", 0)))
    keys = params.pop("keys", entry.defaults.get("keys", "token"))
    rot, seed = params.pop("rot", "none"), params.pop("rotseed", "0")
    smooth = params.pop("smooth", "0")
    center = params.pop("center", "0")
    sink = params.pop("sink", "0")
    outliers = params.pop("outliers", "0")
    ofmt = params.pop("ofmt", None)
    vname, vgroup = params.pop("v", None), params.pop("vgroup", None)
    fit = params.pop("fit", None)
    vcodec = None if vname is None else _value_codec(name, vname, vgroup)
    if vgroup is not None and vname is None:
        raise ValueError(f"{name}: parameter vgroup needs v=<codec> (the values' codec it groups)")
    if not outliers.isdigit() or int(outliers) > 256:
        raise ValueError(f"{name}: parameter outliers must be an integer in [0, 256], got {outliers!r}")
    if ofmt is not None and ofmt not in KEPT_FORMATS:
        raise ValueError(f"{name}: parameter ofmt must be one of {', '.join(KEPT_FORMATS)}, got {ofmt!r}")
    if ofmt is not None and not int(outliers):
        raise ValueError(f"{name}: parameter ofmt={ofmt} needs outliers=c (the kept channels it stores)")
    if rot not in ("none", "hadamard"):
        raise ValueError(f"{name}: parameter rot must be 'none' or 'hadamard', got {rot!r}")
    if not seed.isdigit() or int(seed) >= 1 << 31:
        raise ValueError(f"{name}: parameter rotseed must be an integer in [0, 2^31), got {seed!r}")
    if not sink.isdigit() or int(sink) > MAX_SINK:
        raise ValueError(f"{name}: parameter sink must be an integer in [0, {MAX_SINK}], got {sink!r}")
    if center not in ("0", "1"):
        raise ValueError(f"{name}: parameter center must be 0 or 1, got {center!r}")
    try:
        smooth_f = float(smooth)
    except ValueError:
        smooth_f = -1.0
    if not 0 <= smooth_f <= 1:
        raise ValueError(f"{name}: parameter smooth must be a number in [0, 1], got {smooth!r}")
    try:
        r_int = int(r)
    except ValueError:
        raise ValueError(f"{name}: parameter r={r!r} is not an integer") from None
    if not 0 <= r_int <= MAX_RECENT:
        raise ValueError(f"{name}: parameter r must be >= 0 and <= {MAX_RECENT}, got {r_int}")
    if keys not in ("token", "channel"):
        raise ValueError(f"{name}: parameter keys must be 'token' or 'channel', got {keys!r}")
    cls = entry.cls
    codec = cls(**coerce_params(cls, params, f"method {name}"))
    if fit is not None:  # one fit for every code of the recipe that has one (keys', values')
        fitted = [c for c in (codec, vcodec) if c is not None and hasattr(c, "fit")]
        if not fitted:
            raise ValueError(f"{name}: parameter fit applies to int4, int3, int2 and nvfp4 codes; "
                             "this recipe has none")
        codec, vcodec = (replace(c, fit=fit) if c in fitted else c for c in (codec, vcodec))
    if keys == "channel" and not hasattr(codec, "group"):
        raise ValueError(f"{name}: keys=channel needs a grouped integer codec")
    if keys == "channel" and int(outliers):
        raise ValueError(f"{name}: outliers needs keys=token (keys grouped per channel already scale each "
                         "channel apart)")
    return StoreRecipe(codec, r_int, keys, rot=rot, rot_seed=int(seed), smooth=smooth_f,
                       center=center == "1", sink=int(sink), outliers=int(outliers),
                       outlier_fmt=ofmt or "bf16", vcodec=vcodec)


def _value_codec(name: str, vname: str, vgroup: str | None) -> Codec:
    """The codec `v=<name>` gives the values: its default parameters, its group `vgroup=` if given."""
    entry = REGISTRY.get(vname.lower())
    if entry is None or entry.stratum != "store":
        known = ", ".join(n for n, e in REGISTRY.items() if e.stratum == "store")
        raise ValueError(f"{name}: parameter v must name a store codec for the values ({known}), "
                         f"got {vname!r}")
    if vgroup is None:
        return entry.cls()
    if "group" not in {f.name for f in fields(entry.cls)}:
        raise ValueError(f"{name}: parameter vgroup needs a grouped values codec (int4, int3, int2), "
                         f"got v={vname}")
    return entry.cls(**coerce_params(entry.cls, {"group": vgroup}, f"method {name} (vgroup)"))


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
    if depths and store.rot != "none":
        raise ValueError(f"{text!r}: a rotation does not combine with depth sharing")
    for what, on in (("key smoothing", store.smooth), ("key centering", store.center),
                     ("a sink (sink=)", store.sink),
                     ("outlier channels", store.outliers),
                     ("a values codec (v=)", store.vcodec)):
        if (depths or reads) and on:
            raise ValueError(f"{text!r}: {what} does not combine with depth sharing or top-k reads")
    if depths and store.key_axis == "channel":
        store = replace(store, key_axis="token")  # depth blocks group tokens themselves
    return replace(
        store, keep=keeps[0] if keeps else None, depth=depths[0] if depths else None,
        read=reads[0] if reads else None,
    )


def parse_method(text: str) -> MethodSpec:
    """Parse a method spec string; raises ValueError naming what is wrong. Specs are immutable, so
    each text is parsed once (per registry state) and the same MethodSpec is handed out again."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("method spec is empty")
    return _parse(text, registry.generation())


_LAYERS = re.compile(r"layers\[([^\]]*)\]\s*=(.*)", re.S)
_CLASS = re.compile(r"(full|sliding)\s*=(.*)", re.S | re.I)
MAX_LAYER = 4096  # beyond any model's depth: an index above it is a typo


def parse_ranges(text: str, where: str, what: str, top: int) -> tuple[int, ...]:
    """`"0-3,7"` -> (0, 1, 2, 3, 7), in order, each once; raises ValueError naming `where` and the
    bad item (`what`: "a layer index"; `top`: the largest index allowed)."""
    out: list[int] = []
    for item in (p.strip() for p in text.split(",")):
        lo, dash, hi = item.partition("-")
        if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
            raise ValueError(f"{where}: {item!r} is not {what} or an i-j range")
        a, b = int(lo), int(hi) if dash else int(lo)
        if a > b or b > top:
            raise ValueError(f"{where}: range {item!r} is empty or beyond {top}")
        out += range(a, b + 1)
    return tuple(dict.fromkeys(out))


def parse_layers(text: str) -> frozenset[int]:
    """`"0-3,7"` -> {0, 1, 2, 3, 7}; raises ValueError naming the bad item."""
    return frozenset(parse_ranges(text, f"layers[{text}]", "a layer index", MAX_LAYER))


def _check_override(recipe: StoreRecipe, chunk: str) -> StoreRecipe:
    if recipe.depth is not None or recipe.read is not None:
        raise ValueError(f"{chunk!r}: depth sharing and top-k reads apply to the whole model, not to "
                         "listed layers")
    return recipe


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
            layers.append((members, _check_override(_parse_recipe(by_layer[2]), chunk)))
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
