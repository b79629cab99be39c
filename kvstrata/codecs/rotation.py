"""Randomized Hadamard rotation of K/V along head_dim before encoding (incoherence processing, as
in QuaRot and QuIP#): a few large channels are spread over all of them, so a block's scale is no
longer set by one outlier. `x @ R` with `R = D H / sqrt(d)` (H Hadamard, D random signs from a fixed,
recorded seed) is orthogonal, so `(q R) . (k R) = q . k` and values come back as `(p V R) R^T`;
nothing per token is stored, so bytes per token do not change."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from kvstrata.codecs.transform import Attend, State, Transform
from kvstrata.knobs import choice, integer, knob


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform along the last dimension (a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of two, got {d}")
    y, h = x, 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape)


@lru_cache(maxsize=32)
def hadamard_rotation(d: int, seed: int = 0) -> torch.Tensor:
    """The orthogonal float32 `[d, d]` matrix `D H / sqrt(d)`; the same for a given (d, seed)."""
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0
    return fwht(torch.diag(signs)) / d**0.5


def rotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """`x @ r` along the last dimension, computed in at least float32, returned in x's dtype
    (identity when `r` is None)."""
    if r is None:
        return x
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (x.to(dtype) @ r.to(x.device, dtype)).to(x.dtype)


def unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    return rotate(x, None if r is None else r.T)


@dataclass(frozen=True)
class Rotation(Transform):
    """K and V rotated along head_dim; the query is rotated the same way and the output back."""

    rot: str = knob(
        "none", "hadamard: K and V rotated along head_dim by a randomized Hadamard matrix before encoding, "
        "the query rotated the same way and the attention output rotated back; nothing per token is "
        "stored", "none, hadamard", choice("none", "hadamard"), position=30)
    rotseed: int = knob(0, "the seed of the rotation's random signs", "[0, 2^31)", integer(0, 2**31 - 1),
                        position=31, needs="rot")
    order: ClassVar[int] = 40
    acts_on_values: ClassVar[bool] = True

    def check(self, kv_heads: int, head_dim: int) -> None:
        if head_dim & (head_dim - 1):
            raise ValueError(f"a Hadamard rotation needs head_dim a power of two, got {head_dim}")

    def matrix(self, d: int) -> torch.Tensor:
        return hadamard_rotation(d, self.rotseed)

    def forward(self, keys, values, state):
        r = self.matrix(keys.shape[-1])
        return rotate(keys, r), rotate(values, r), {}

    def inverse_keys(self, keys, state, side):
        return unrotate(keys, self.matrix(keys.shape[-1]))

    def inverse_values(self, values, state):
        return unrotate(values, self.matrix(values.shape[-1]))

    def enter(self, a: Attend, state: State, side):
        r = self.matrix(a.query.shape[-1])
        a.query, a.tail_k, a.tail_v = rotate(a.query, r), rotate(a.tail_k, r), rotate(a.tail_v, r)
        return lambda out: unrotate(out, r)
