"""transformers integration: the compressed `Cache` and helpers to run models with it."""

from kvstrata.hf.cache import CompressedCache, layer_classes

__all__ = ["CompressedCache", "layer_classes"]
