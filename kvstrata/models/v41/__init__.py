"""The V4.1 reference architecture (CED + CSA2 + FP4 global KV), runnable on a CPU."""

from kvstrata.models.v41.cache import V41Cache
from kvstrata.models.v41.config import V41Config, preset
from kvstrata.models.v41.modeling import V41ForCausalLM

__all__ = ["V41Cache", "V41Config", "V41ForCausalLM", "preset"]
