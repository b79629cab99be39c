"""The element-codec contract."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from kvstrata.codecs.qtensor import QTensor


class Codec(Protocol):
    """A pure element codec: dense tensor in, `QTensor` out, and back. Blocks run along the last dim."""

    name: ClassVar[str]
    #: how each element is laid out in the block's codes (for accounting and docs)
    summary: ClassVar[str]

    def encode(self, x: torch.Tensor) -> QTensor: ...

    def decode(self, q: QTensor) -> torch.Tensor: ...
