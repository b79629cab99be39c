"""The packed result of a codec: codes + scales, self-describing, with honest byte counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.codecs.spec import spec_of


def held_bytes(tensors) -> int:
    """Bytes of storage actually held by `tensors` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(kw_only=True)
class QTensor:
    """A quantized tensor.

    `parts` holds the stored tensors (e.g. `codes: [..., n_blocks, block_bytes] uint8`,
    `scales: [..., n_blocks]`); leading dims equal the original tensor's leading dims, blocks run
    along the original last dimension. `codec` is the codec instance that made it (its `spec`
    string goes into record headers), so the tensor decodes without outside context.
    """

    codec: object
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode back to a dense tensor of the original shape (and dtype unless given)."""
        return self.codec.decode(self).to(dtype or self.dtype)

    @property
    def spec(self) -> str:
        """The codec's canonical spec string (what a record header stores)."""
        return spec_of(self.codec)

    @property
    def nbytes(self) -> int:
        """Everything stored: codes, block scales, zero points, per-tensor scale."""
        return held_bytes(self.parts.values())

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"QTensor(spec={self.spec!r}, shape={self.shape}, nbytes={self.nbytes})"
