"""kvstrata: KV-cache compression and lifetime management, organised by stratum
(keep / store / read / place), measured on real models.

Importing `kvstrata` loads nothing heavy (the CLI answers `--help` without torch): `quantize`,
`QTensor` and the subpackages load on first use (PEP 562). The method registry is filled by the
stratum packages themselves, which `kvstrata.methods` (the spec grammar) imports.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["QTensor", "quantize", "__version__"]


def __getattr__(name: str):
    if name in ("QTensor", "quantize"):
        return getattr(importlib.import_module("kvstrata.codecs"), name)
    try:
        return importlib.import_module(f"kvstrata.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"kvstrata.{name}":
            raise
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}") from None
