"""Store stratum: how a kept KV entry is encoded. One codec per module, one registry here."""

from __future__ import annotations

from functools import lru_cache

import torch

from kvstrata.codecs.base import Codec, coerce_params
from kvstrata.codecs.bf16 import BF16
from kvstrata.codecs.fp8 import FP8
from kvstrata.codecs.intq import INT2, INT4
from kvstrata.codecs.mxfp4 import MXFP4
from kvstrata.codecs.nvfp4 import NVFP4
from kvstrata.codecs.qtensor import QTensor

CODECS: dict[str, type] = {c.name: c for c in (BF16, FP8, MXFP4, NVFP4, INT4, INT2)}


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


def build(spec: str, registry: dict[str, type], kind: str = "method"):
    """Instance of the registry entry a spec names, with its parameters typed and checked."""
    name, params = split_spec(spec)
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r} (known: {', '.join(registry)})")
    cls = registry[name]
    return cls(**coerce_params(cls, params, f"{kind} {name}"))


@lru_cache(maxsize=256)
def get_codec(spec: str) -> Codec:
    """Codec instance for a spec such as `nvfp4`, `fp8:block=32` or `int4:group=64` (codecs are
    immutable, so one instance per spec is resolved once and shared)."""
    return build(spec, CODECS, "codec")


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """Encode `x` with the codec `fmt` (blocks along the last dimension)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        x = x.reshape(1)
    return get_codec(fmt).encode(x)


__all__ = ["CODECS", "Codec", "QTensor", "build", "get_codec", "quantize", "split_spec"]
