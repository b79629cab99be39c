"""A decode step's linear layers through the C++ extension (`linear_rows`, `read/kernels/linear.h`).

torch's CPU linear (MKL) is tuned for large batches: on this project's 2-core machine 8 rows of a
SmolLM2 projection cost 2.3-4.2x one row, although the weights, read once, are the whole cost, and
its bf16 path is slower than float32. `linear_rows` streams each weight row once for all rows of the
step and sums every output in one fixed order, so a row's result does not depend on the rows beside
it: a batched step computes what the single one does (batched answers equal `generate`'s), and bf16
weights are read as bf16 (half the bytes). `install(model)` turns a model's `nn.Linear` modules into
`RowsLinear` (same parameters, same state dict); on the CPU without gradients, a call of at most
`ROWS` rows takes the kernel; a bf16 call of more rows (a prefill) is computed in float32 by torch's
GEMM and rounded once (torch's own bf16 linear, on a CPU without AVX512-BF16, is 2-3x slower than
both); a float32 prefill and anything with gradients use torch's linear as it is.
`KVSTRATA_LINEAR=torch` keeps torch's everywhere (the reference the tests compare with); so does a
build without AVX-512 or without the extension (`KVSTRATA_KERNELS=reference`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.read.kernels import cpu

ROWS = 16  # the most rows a call sends to the kernel (a decode step of up to 16 sequences)
CHOICES = ("kernel", "torch")


def chosen() -> str:
    """`KVSTRATA_LINEAR` (default `kernel`), checked."""
    return cpu.env_choice("KVSTRATA_LINEAR", CHOICES, "kernel")


def kernel():
    """The extension when it computes `linear_rows` here and `KVSTRATA_LINEAR` allows it, else None."""
    if chosen() != "kernel":
        return None
    module = cpu.load()
    return module if module is not None and module.linear_rows_ok() else None


_KERNEL: list = []  # the extension `install` found (kept here, not on modules: models stay deep-copyable)


class RowsLinear(nn.Linear):
    """An `nn.Linear` whose decode-size calls go through `linear_rows` (`_rows`: set by `install`)."""

    _rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._rows and _KERNEL and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and x.dtype in (torch.float32, torch.bfloat16)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            if x.numel() <= ROWS * self.in_features:
                return _KERNEL[0].linear_rows(x, self.weight, self.bias)
            if x.dtype == torch.bfloat16:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Route the decode-size calls of `model`'s plain `nn.Linear` modules through the kernel (when it
    is available); returns how many modules now do."""
    module = kernel()
    if module is None:
        return 0
    _KERNEL[:] = [module]
    count = 0
    for layer in model.modules():
        if type(layer) is nn.Linear or type(layer) is RowsLinear:
            layer.__class__ = RowsLinear
            layer._rows = True
            count += 1
    return count


def in_use(model: nn.Module) -> str:
    """`kernel` when `model`'s linears go through the kernel (as `RowsLinear.forward` decides), else
    `torch` (bench rows record it)."""
    routed = any(getattr(layer, "_rows", False) for layer in model.modules())
    return "kernel" if _KERNEL and routed else "torch"


@contextlib.contextmanager
def torch_linears(model: nn.Module):
    """`model`'s `RowsLinear` modules on torch's linear inside the block (the reference; A/B timing)."""
    saved = [(layer, layer._rows) for layer in model.modules() if isinstance(layer, RowsLinear)]
    for layer, _ in saved:
        layer._rows = False
    try:
        yield
    finally:
        for layer, flag in saved:
            layer._rows = flag
