"""Method specs: strings users type (`nvfp4:r=64`, `int2:group=32,r=128`, `nvfp4;sliding=fp8`).

Grammar::

    spec      := recipe (";" class "=" recipe)*      class in {full, sliding}
    recipe    := component ("+" component)*
    component := name [":" key=value ("," key=value)*]

The first recipe applies to every layer; `full=` / `sliding=` override one class of layers
(V4.1 keeps global KV in FP4 and sliding-window KV in FP8: `nvfp4;sliding=fp8`). One registry
(`kvstrata.registry`) resolves names; each entry says its stratum and its own parameters. A parsed
spec holds config instances; text is rendered back from them only at the edges (`spec_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

import torch

from kvstrata import registry
from kvstrata.codecs import BF16, Codec, build, coerce_params, split_spec
from kvstrata.codecs.rotation import hadamard_rotation
from kvstrata.keep import KeepPolicy
from kvstrata.read import TopK
from kvstrata.registry import REGISTRY

LAYER_CLASSES = ("full", "sliding")
MAX_RECENT = 1 << 24  # r: recent tokens kept in full precision (beyond any context we run)
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

    def rotation(self, head_dim: int) -> torch.Tensor | None:
        """The rotation applied before encoding (`[head_dim, head_dim]`), or None."""
        return hadamard_rotation(head_dim, self.rot_seed) if self.rot == "hadamard" else None

    @cached_property
    def key_group(self) -> int:
        """Tokens encoded together for keys (1 unless keys are grouped per channel)."""
        return getattr(self.codec, "group", 1) if self.key_axis == "channel" else 1


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
    if rot not in ("none", "hadamard"):
        raise ValueError(f"{name}: parameter rot must be 'none' or 'hadamard', got {rot!r}")
    if not seed.isdigit() or int(seed) >= 1 << 31:
        raise ValueError(f"{name}: parameter rotseed must be an integer in [0, 2^31), got {seed!r}")
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
    if keys == "channel" and not hasattr(codec, "group"):
        raise ValueError(f"{name}: keys=channel needs a grouped integer codec")
    return StoreRecipe(codec, r_int, keys, rot=rot, rot_seed=int(seed))


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


@lru_cache(maxsize=1024)
def _parse(text: str, generation: int) -> MethodSpec:
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
