"""Real models (offline, from PyPI packages) and tiny random ones for tests.

The catalog (`KNOWN_MODELS`, `TINY_MODELS`) imports nothing heavy; the loader's names (torch,
transformers) load on first use (PEP 562), so a CLI refusal of a mistyped model name costs no torch.
"""

from __future__ import annotations

import importlib

from kvstrata.models.catalog import KNOWN_MODELS, TINY_MODELS, ModelNotInstalled

LOADER = ("cache_dir", "check_method", "load", "load_config", "load_model", "load_tokenizer", "resolve")
__all__ = ["KNOWN_MODELS", "TINY_MODELS", "ModelNotInstalled", *LOADER]


def __getattr__(name: str):
    if name in LOADER:
        return getattr(importlib.import_module("kvstrata.models.loader"), name)
    raise AttributeError(f"module 'kvstrata.models' has no attribute {name!r}")
