"""The element-codec contract and the parameter parsing every codec shares."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Protocol

import torch

from kvstrata.codecs.qtensor import QTensor


class Codec(Protocol):
    """A pure element codec: dense tensor in, `QTensor` out, and back. Blocks run along the last dim."""

    name: ClassVar[str]
    #: how each element is laid out in the block's codes (for accounting and docs)
    summary: ClassVar[str]

    def encode(self, x: torch.Tensor) -> QTensor: ...

    def decode(self, q: QTensor) -> torch.Tensor: ...


def codec_spec(codec) -> str:
    """Canonical spec string of a codec instance: `name` or `name:k=v,...` (non-default fields only)."""
    params = []
    for f in dataclasses.fields(codec):
        value = getattr(codec, f.name)
        if value != f.default:
            params.append(f"{f.name}={_fmt(value)}")
    return codec.name + (":" + ",".join(params) if params else "")


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


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
