"""kvstrata: KV-cache compression and lifetime management, organised by stratum
(keep / store / read / place), measured on real models."""

# Importing the stratum packages registers their methods in `kvstrata.registry`.
from kvstrata import keep, read  # noqa: F401
from kvstrata.codecs import QTensor, quantize

__version__ = "0.1.0"
__all__ = ["QTensor", "quantize", "__version__"]
