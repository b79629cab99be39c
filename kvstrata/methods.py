"""Method specs: strings users type (`nvfp4:r=64`, `int2:group=32,r=128`, `nvfp4;sliding=fp8`).

Grammar::

    spec      := recipe (";" class "=" recipe)*      class in {full, sliding}
    recipe    := component ("+" component)*
    component := name [":" key=value ("," key=value)*]

The first recipe applies to every layer; `full=` / `sliding=` override one class of layers
(V4.1 keeps global KV in FP4 and sliding-window KV in FP8: `nvfp4;sliding=fp8`). One registry
(`METHODS`) resolves names; each entry says its stratum and its own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from kvstrata.codecs import CODECS, build, coerce_params, get_codec, split_spec
from kvstrata.codecs.base import codec_spec
from kvstrata.codecs.depth import FreqDepth
from kvstrata.codecs.minicache import MiniCache
from kvstrata.keep import KEEP_POLICIES
from kvstrata.read.sparse import TopK

LAYER_CLASSES = ("full", "sliding")
MAX_RECENT = 1 << 24  # r: recent tokens kept in full precision (beyond any context we run)


@dataclass(frozen=True)
class StoreRecipe:
    """How one class of layers stores K/V.

    codec: canonical element-codec spec; r: most recent tokens kept in full precision (KIVI
    residual, 0 allowed); key_axis: "token" (scales per token, along head_dim) or "channel"
    (KIVI keys: groups run along tokens, so tokens are encoded `group` at a time).
    """

    codec: str = "bf16"
    r: int = 0
    key_axis: str = "token"
    keep: str | None = None  # canonical keep-policy spec, applied to the context after prefill
    depth: str | None = None  # canonical depth-sharing spec (FreqDepthKV) for groups of adjacent layers
    read: str | None = None  # canonical read-stratum spec (top-k sparse decode reads)

    # Objects are resolved from the canonical strings once per recipe (recipes are immutable), so
    # nothing on the encode / decode path parses a spec or looks up a registry.
    @cached_property
    def codec_obj(self):
        """The element codec instance."""
        return get_codec(self.codec)

    @cached_property
    def _read(self):
        return build(self.read, READ_METHODS) if self.read else None

    @cached_property
    def _depth(self):
        return build(self.depth, DEPTH_METHODS) if self.depth else None

    @cached_property
    def _keep(self):
        return build(self.keep, KEEP_POLICIES) if self.keep else None

    def read_config(self):
        """The sparse-read config (TopK) instance, or None for dense reads."""
        return self._read

    def depth_config(self):
        """The depth-sharing codec (FreqDepth, MiniCache) instance, or None."""
        return self._depth

    def keep_policy(self):
        """The keep policy instance, or None when every token is kept."""
        return self._keep

    @cached_property
    def key_group(self) -> int:
        """Tokens encoded together for keys (1 unless keys are grouped per channel)."""
        return getattr(self.codec_obj, "group", 1) if self.key_axis == "channel" else 1


@dataclass(frozen=True)
class MethodEntry:
    name: str
    stratum: str
    summary: str
    defaults: dict = field(default_factory=dict)  # method-level parameter defaults (besides the codec's)


def _codec_entry(name: str) -> MethodEntry:
    cls = CODECS[name]
    integer = name.startswith("int")
    defaults = {"r": 128, "keys": "channel"} if integer else {"r": 0, "keys": "token"}
    return MethodEntry(name, "store", cls.summary, defaults)


METHODS: dict[str, MethodEntry] = {name: _codec_entry(name) for name in CODECS}
METHODS.update({name: MethodEntry(name, "keep", cls.summary) for name, cls in KEEP_POLICIES.items()})
DEPTH_METHODS = {c.name: c for c in (FreqDepth, MiniCache)}
METHODS.update({name: MethodEntry(name, "depth", cls.summary) for name, cls in DEPTH_METHODS.items()})
READ_METHODS = {c.name: c for c in (TopK,)}
METHODS.update({name: MethodEntry(name, "read", cls.summary) for name, cls in READ_METHODS.items()})


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method: one recipe per layer class."""

    text: str
    full: StoreRecipe
    sliding: StoreRecipe

    def recipe(self, layer_class: str) -> StoreRecipe:
        return self.sliding if layer_class == "sliding" else self.full

    def __str__(self) -> str:
        return self.text


def _parse_component(text: str) -> StoreRecipe | str | tuple[str, str]:
    """A store component -> StoreRecipe; a keep component -> its canonical spec string."""
    name, params = split_spec(text)
    if not name:
        raise ValueError(f"empty method name in {text!r}")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} in {text!r} (known: {', '.join(METHODS)})")
    entry = METHODS[name]
    if entry.stratum == "keep":
        return codec_spec(build(text, KEEP_POLICIES))
    if entry.stratum in ("depth", "read"):
        registry = DEPTH_METHODS if entry.stratum == "depth" else READ_METHODS
        return (entry.stratum, codec_spec(build(text, registry)))
    r = params.pop("r", str(entry.defaults.get("r", 0)))
    keys = params.pop("keys", entry.defaults.get("keys", "token"))
    try:
        r_int = int(r)
    except ValueError:
        raise ValueError(f"{name}: parameter r={r!r} is not an integer") from None
    if not 0 <= r_int <= MAX_RECENT:
        raise ValueError(f"{name}: parameter r must be >= 0 and <= {MAX_RECENT}, got {r_int}")
    if keys not in ("token", "channel"):
        raise ValueError(f"{name}: parameter keys must be 'token' or 'channel', got {keys!r}")
    cls = CODECS[name]
    codec = cls(**coerce_params(cls, params, f"method {name}"))
    if keys == "channel" and not hasattr(codec, "group"):
        raise ValueError(f"{name}: keys=channel needs a grouped integer codec")
    return StoreRecipe(codec_spec(codec), r_int, keys)


def _parse_recipe(text: str) -> StoreRecipe:
    parts = [p.strip() for p in text.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"empty component in {text!r}")
    parsed = [_parse_component(p) for p in parts]
    stores = [r for r in parsed if isinstance(r, StoreRecipe)]
    keeps = [r for r in parsed if isinstance(r, str)]
    depths = [r[1] for r in parsed if isinstance(r, tuple) and r[0] == "depth"]
    reads = [r[1] for r in parsed if isinstance(r, tuple) and r[0] == "read"]
    for what, found in (("element codecs", stores), ("keep policies", keeps), ("depth-sharing methods", depths),
                        ("read methods", reads)):
        if len(found) > 1:
            raise ValueError(f"{text!r} combines {len(found)} {what}; a recipe takes at most one")
    store = stores[0] if stores else StoreRecipe()
    if depths and store.key_axis == "channel":
        store = replace(store, key_axis="token")  # depth blocks group tokens themselves
    return replace(store, keep=keeps[0] if keeps else None, depth=depths[0] if depths else None,
                   read=reads[0] if reads else None)


def parse_method(text: str) -> MethodSpec:
    """Parse a method spec string; raises ValueError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("method spec is empty")
    chunks = [c.strip() for c in text.split(";")]
    base = _parse_recipe(chunks[0])
    per_class = {"full": base, "sliding": base}
    given = set()
    for chunk in chunks[1:]:
        cls, eq, recipe = chunk.partition("=")
        cls = cls.strip().lower()
        if not eq or cls not in LAYER_CLASSES:
            raise ValueError(f"{chunk!r}: expected <class>=<recipe> with class in {LAYER_CLASSES}")
        if cls in given:
            raise ValueError(f"{text.strip()!r}: layer class {cls!r} given twice")
        given.add(cls)
        per_class[cls] = _parse_recipe(recipe)
    return MethodSpec(text.strip(), per_class["full"], per_class["sliding"])
