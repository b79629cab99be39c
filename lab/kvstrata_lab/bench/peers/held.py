"""What a peer's cache actually holds, counted from its tensors rather than from its claims."""

from __future__ import annotations

import torch


def held_bytes(cache) -> dict:
    """Bytes of every tensor reachable from `cache`'s layers, each storage counted once.

    `bytes`: floating-point tensors at 16 bits per element (the bf16 width our reference stores;
    the peers run in float32 on this CPU), integer and packed tensors at their real width.
    `in_memory`: the storages behind those tensors as this process holds them (real width, and
    whole storages where a cache keeps a slice of a larger buffer).
    `entries`: key positions held, summed over layers and KV heads (unquantized layers)."""
    seen: set = set()
    totals = {"bytes": 0, "in_memory": 0, "entries": 0}
    for layer in cache.layers:
        _walk(vars(layer), seen, totals)
        keys = getattr(layer, "keys", None)
        if (
            getattr(layer, "_quantized_keys", None) is None
            and isinstance(keys, torch.Tensor)
            and keys.dim() == 4
        ):
            totals["entries"] += keys.shape[1] * keys.shape[2]
    return totals


def _walk(obj, seen: set, totals: dict) -> None:
    if isinstance(obj, torch.Tensor):
        inner = getattr(obj, "__tensor_flatten__", None)
        if inner is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = inner()  # a tensor subclass (quanto's QBitsTensor): count its plain parts
            for name in names:
                _walk(getattr(obj, name), seen, totals)
            return
        storage = obj.untyped_storage()
        view = (storage.data_ptr(), obj.storage_offset(), tuple(obj.shape))
        if obj.numel() and view not in seen:
            seen.add(view)
            totals["bytes"] += obj.numel() * (2 if obj.is_floating_point() else obj.element_size())
        if storage.nbytes() and storage.data_ptr() not in seen:  # a view keeps its whole storage alive
            seen.add(storage.data_ptr())
            totals["in_memory"] += storage.nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, seen, totals)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk(value, seen, totals)
