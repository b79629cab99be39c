"""The one method registry: every name a method spec may use, with its stratum, config class,
method-level defaults and the tolerance the contract tests hold it to.

Each stratum package registers its own methods with one line each (`kvstrata.codecs`,
`kvstrata.keep`, `kvstrata.read`); importing `kvstrata.methods` (the spec grammar, which imports every
stratum) fills it -- `import kvstrata` alone loads nothing heavy. Nothing here imports a stratum, so
every layer of the library may read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType

STRATA = ("store", "keep", "depth", "read")
#: KIVI's settings for integer codecs: the newest 128 tokens in full precision, keys per channel.
KIVI = MappingProxyType({"r": 128, "keys": "channel"})
PLAIN = MappingProxyType({"r": 0, "keys": "token"})


@dataclass(frozen=True)
class Tolerance:
    """What the contract suite allows a store codec: `element`, the largest round-trip error as a
    fraction of the absolute maximum of the `block` elements that share a scale; `logits`, the mean
    absolute logit drift of a tiny model decoding over an encoded cache against the dense one."""

    element: float
    logits: float
    block: int = 64


@dataclass(frozen=True)
class Entry:
    cls: type
    stratum: str
    defaults: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    tolerance: Tolerance | None = None

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def summary(self) -> str:
        return self.cls.summary


REGISTRY: dict[str, Entry] = {}
_generation = [0]  # bumped on every change, so lookups cached by spec string never go stale


def register(cls: type, stratum: str, *, defaults=None, tolerance: Tolerance | None = None) -> type:
    """Add `cls` (a frozen dataclass with ClassVars `name` and `summary`) under its name."""
    if stratum not in STRATA:
        raise ValueError(f"stratum must be one of {', '.join(STRATA)}, got {stratum!r}")
    if cls.name in REGISTRY and REGISTRY[cls.name].cls is not cls:
        raise ValueError(f"method name {cls.name!r} is already registered by "
                         f"{REGISTRY[cls.name].cls.__name__}")
    if stratum == "store":
        defaults = defaults if defaults is not None else PLAIN
        if tolerance is None:
            raise ValueError(f"store codec {cls.name!r} needs a Tolerance for the contract suite")
    REGISTRY[cls.name] = Entry(cls, stratum, MappingProxyType(dict(defaults or {})), tolerance)
    _generation[0] += 1
    return cls


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)
    _generation[0] += 1


def generation() -> int:
    return _generation[0]


#: key transforms (`kvstrata.codecs.transform`), in pipeline order: their knobs are recipe knobs
TRANSFORMS: list[type] = []


def register_transform(cls: type) -> type:
    """Add a key transform (a frozen dataclass whose `knob` fields are recipe knobs, ClassVar `order`)."""
    keys = {f.name for f in fields(cls) if "knob" in f.metadata}
    if not keys:
        raise ValueError(f"transform {cls.__name__} declares no knob fields")
    for other in TRANSFORMS:
        clash = keys & {f.name for f in fields(other) if "knob" in f.metadata}
        if other is not cls and clash:
            raise ValueError(f"transform {cls.__name__}: knob {sorted(clash)[0]!r} is already "
                             f"{other.__name__}'s")
    if cls not in TRANSFORMS:
        TRANSFORMS.append(cls)
        TRANSFORMS.sort(key=lambda c: c.order)
    _generation[0] += 1
    return cls


def unregister_transform(cls: type) -> None:
    if cls in TRANSFORMS:
        TRANSFORMS.remove(cls)
    _generation[0] += 1


def classes(stratum: str) -> dict[str, type]:
    """Name -> config class of every method registered in `stratum`."""
    return {n: e.cls for n, e in REGISTRY.items() if e.stratum == stratum}


def entries(stratum: str) -> list[Entry]:
    return [e for e in REGISTRY.values() if e.stratum == stratum]
