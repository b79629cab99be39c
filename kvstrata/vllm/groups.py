"""vLLM's KV-cache groups as the connector sees them: each group's model layers (by index, read from
the attention layers' names) and its sliding window; only full-attention and sliding-window groups."""

from __future__ import annotations

import re

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvstrata.vllm.plan import Groups
from kvstrata.vllm.settings import ConfigError


def layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", name)
    if not found:
        raise ConfigError(f"kvstrata connector: cannot tell the layer index of attention layer {name!r}")
    return int(found[-1])


def engine_groups(kv_cache_config, n_layers: int) -> Groups:
    """The engine's KV-cache groups by model layer index; full-attention and sliding-window groups only."""
    if kv_cache_config is None:
        return Groups.single(n_layers)
    layers, windows = [], []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            windows.append(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec):
            windows.append(None)
        else:
            raise ConfigError(f"kvstrata connector: KV-cache group of {type(spec).__name__} layers "
                              f"({group.layer_names[:2]}...): only full and sliding-window attention")
        layers.append(tuple(layer_index(name) for name in group.layer_names))
    return Groups(layers=tuple(layers), windows=tuple(windows))
