"""The element-codec contract."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from kvstrata.codecs.qtensor import QTensor


class Codec(Protocol):
    """A pure element codec: dense tensor in, `QTensor` out, and back. Blocks run along the last dim."""

    name: ClassVar[str]
    #: how each element is laid out in the block's codes (for accounting and docs)
    summary: ClassVar[str]

    def encode(self, x: torch.Tensor) -> QTensor: ...

    def decode(self, q: QTensor) -> torch.Tensor: ...


@runtime_checkable
class SharedScale(Protocol):
    """A codec with a per-tensor scale that later rows can be encoded under (NVFP4): a segment with
    spare rows takes one with headroom, and an append checks its rows fit it."""

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor: ...

    def fits(self, x: torch.Tensor, scale: torch.Tensor) -> bool: ...
