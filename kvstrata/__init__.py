"""kvstrata: KV-cache compression and lifetime management, organised by stratum
(keep / store / read / place), measured on real models."""

from kvstrata.codecs import QTensor, quantize

__version__ = "0.1.0"
__all__ = ["QTensor", "quantize", "__version__"]
