"""bf16: the uncompressed reference store (2 bytes per element)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.blocks import check_finite
from kvstrata.codecs.qtensor import QTensor


@dataclass(frozen=True)
class BF16:
    name: ClassVar[str] = "bf16"
    summary: ClassVar[str] = "bfloat16, 16 bits per element, no scales (the reference)"

    def encode(self, x: torch.Tensor) -> QTensor:
        check_finite(x, self.name)
        return QTensor(codec=self, shape=tuple(x.shape), dtype=x.dtype,
                       parts={"values": x.to(torch.bfloat16).contiguous()})

    def decode(self, q: QTensor) -> torch.Tensor:
        return q.parts["values"].float()
