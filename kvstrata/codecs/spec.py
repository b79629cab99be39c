"""Spec strings <-> config objects: the one place a method's text is parsed or rendered.

Strings exist only at the edges (CLI, record headers, store namespaces, JSONL rows); inside the
library every codec, keep policy, depth and read config is an immutable dataclass instance.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from kvstrata import registry


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`"int2:group=32,r=128"` -> `("int2", {"group": "32", "r": "128"})`."""
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"{spec!r}: parameter {item!r} must look like key=value")
        if key.strip() in params:
            raise ValueError(f"{spec!r}: parameter {key.strip()!r} given twice")
        params[key.strip()] = value.strip()
    return name.strip().lower(), params


def coerce_params(cls, params: dict[str, str], where: str) -> dict:
    """Turn `{"group": "32"}` into typed dataclass kwargs, naming the bad key or value on error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, raw in params.items():
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"{where}: unknown parameter {key!r} (known: {known})")
        kind = type(fields[key].default)
        try:
            if kind is bool:
                if raw.lower() not in ("0", "1", "true", "false"):
                    raise ValueError
                out[key] = raw.lower() in ("1", "true")
            else:
                out[key] = kind(raw)
                if kind is float and not math.isfinite(out[key]):
                    raise ValueError
        except ValueError:
            raise ValueError(f"{where}: parameter {key}={raw!r} is not a valid {kind.__name__}") from None
    return out


def spec_of(obj) -> str:
    """Canonical spec string of a config instance: `name` or `name:k=v,...` (non-default fields)."""
    params = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value != f.default:
            params.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
    return obj.name + (":" + ",".join(params) if params else "")


def build(spec: str, stratum: str, kind: str = "method"):
    """Instance of the registered `stratum` method a spec names, its parameters typed and checked."""
    return _build(spec, stratum, kind, registry.generation())


@lru_cache(maxsize=512)
def _build(spec: str, stratum: str, kind: str, generation: int):
    # Configs are immutable, so one instance per spec (and registry state) is built once and shared.
    name, params = split_spec(spec)
    known = registry.classes(stratum)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r} (known: {', '.join(known)})")
    cls = known[name]
    return cls(**coerce_params(cls, params, f"{kind} {name}"))


def get_codec(spec: str):
    """Codec instance for a spec such as `nvfp4`, `fp8:block=32` or `int4:group=64`."""
    return build(spec, "store", "codec")
