"""Store stratum: how a kept KV entry is encoded. One codec per module, one registry line each.

Key transforms (centering, smoothing, outlier channels, rotation) are applied before a codec
and undone after it; they register as transforms, their knobs become recipe knobs.
The depth-sharing methods (FreqDepthKV, MiniCache) encode groups of layers through an element
codec, so they live here too and register in the `depth` stratum.
"""

from __future__ import annotations

import torch

from kvstrata.codecs.base import Codec
from kvstrata.codecs.bf16 import BF16
from kvstrata.codecs.center import Center
from kvstrata.codecs.depth import FreqDepth
from kvstrata.codecs.fp8 import FP8
from kvstrata.codecs.intq import INT2, INT3, INT4
from kvstrata.codecs.minicache import MiniCache
from kvstrata.codecs.mxfp4 import MXFP4
from kvstrata.codecs.nvfp4 import NVFP4
from kvstrata.codecs.outliers import Outliers
from kvstrata.codecs.qtensor import QTensor
from kvstrata.codecs.rotation import Rotation
from kvstrata.codecs.smoothing import Smooth
from kvstrata.codecs.spec import build, coerce_params, get_codec, spec_of, split_spec
from kvstrata.registry import KIVI, Tolerance, register, register_transform

register(BF16, "store", tolerance=Tolerance(element=2**-8, logits=0.01))
register(FP8, "store", tolerance=Tolerance(element=2**-3, logits=0.05))
register(MXFP4, "store", tolerance=Tolerance(element=0.5, logits=0.2, block=32))
register(NVFP4, "store", tolerance=Tolerance(element=0.25, logits=0.2, block=16))
register(INT4, "store", defaults=KIVI, tolerance=Tolerance(element=1 / 15 + 1e-3, logits=0.1, block=32))
register(INT3, "store", defaults=KIVI, tolerance=Tolerance(element=1 / 7 + 1e-3, logits=0.25, block=32))
register(INT2, "store", defaults=KIVI, tolerance=Tolerance(element=1 / 3 + 1e-3, logits=0.5, block=32))
register(FreqDepth, "depth")
register(MiniCache, "depth")
register_transform(Center)
register_transform(Smooth)
register_transform(Outliers)
register_transform(Rotation)


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """Encode `x` with the codec `fmt` (blocks along the last dimension)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        x = x.reshape(1)
    return get_codec(fmt).encode(x)


__all__ = ["BF16", "FP8", "INT2", "INT3", "INT4", "MXFP4", "NVFP4", "FreqDepth", "MiniCache", "Codec",
    "Center", "Outliers", "Rotation", "Smooth", "QTensor", "build", "coerce_params", "get_codec", "quantize",
    "spec_of", "split_spec"]
