"""FreqDepthKV's depth transform: an orthonormal DCT-II across a group of adjacent layers.

For a group of G layers' K (or V) of one head, `x: [G, ..., tokens, head_dim]`, the F lowest
depth frequencies are kept dense (shared by the group) and the high-frequency residual of each
layer is kept only for the top-r tokens ranked by how much it perturbs attention logits. With
F = G every coefficient is kept and the round trip is exact (to float rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def dct_matrix(g: int, dtype=torch.float64) -> torch.Tensor:
    """Orthonormal DCT-II `[g, g]`: `C[k, n] = s_k cos(pi (n + 1/2) k / g)`; `C @ C.T = I`."""
    n = torch.arange(g, dtype=dtype)
    k = n[:, None]
    c = torch.cos(math.pi * (n[None, :] + 0.5) * k / g)
    c[0] *= math.sqrt(1.0 / g)
    c[1:] *= math.sqrt(2.0 / g)
    return c


def depth_dct(x: torch.Tensor) -> torch.Tensor:
    """`x: [G, ...]` -> DCT coefficients along dim 0 (same shape); coefficient 0 is the depth mean."""
    c = dct_matrix(x.shape[0]).to(x.dtype)
    return torch.tensordot(c, x, dims=([1], [0]))


def depth_idct(coeffs: torch.Tensor) -> torch.Tensor:
    c = dct_matrix(coeffs.shape[0]).to(coeffs.dtype)
    return torch.tensordot(c.T, coeffs, dims=([1], [0]))


def low_band(x: torch.Tensor, f: int) -> torch.Tensor:
    """Reconstruction of `x: [G, ...]` from its `f` lowest depth frequencies."""
    coeffs = depth_dct(x)
    coeffs[f:] = 0
    return depth_idct(coeffs)


def low_energy_share(x: torch.Tensor, f: int = 1) -> torch.Tensor:
    """Share of energy in the `f` lowest depth frequencies, per trailing position: `x: [G, ...]`
    -> `[...]` summed over the last dim (head_dim)."""
    coeffs = depth_dct(x.double())
    total = coeffs.pow(2).sum(0).sum(-1)
    return (coeffs[:f].pow(2).sum(0).sum(-1) / total.clamp(min=1e-30)).float()


@dataclass
class DepthSplit:
    """Shared low band + sparse per-layer residual of one group.

    coeffs: `[f, b, h, T, d]`; idx: `[G, b, h, k]` token positions whose residual is kept;
    residual: `[G, b, h, k, d]`; scales: `[G, b, h, 1, 1]` per-layer magnitudes (ones if unused).
    """

    coeffs: torch.Tensor
    idx: torch.Tensor
    residual: torch.Tensor
    scales: torch.Tensor
    groups: int


def split(
    x: torch.Tensor, f: int, r: float, queries: torch.Tensor | None = None, normalise: bool = False
) -> DepthSplit:
    """`x: [G, b, h, T, d]` -> DepthSplit keeping the top `ceil(r * T)` residual tokens per layer and head.

    Tokens are ranked by how much their residual moves attention logits, `max_q |q . res_t|` over
    `queries: [G, b, h, Q, d]` (recent queries, GQA-grouped to KV heads), or by residual norm.
    """
    g, b, h, t, d = x.shape
    if not 1 <= f <= g:
        raise ValueError(f"f must be in [1, {g}], got {f}")
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"r must be a fraction in [0, 1], got {r}")
    scales = (
        x.pow(2).mean(dim=(-1, -2), keepdim=True).sqrt().clamp(min=1e-12)
        if normalise
        else torch.ones(g, b, h, 1, 1)
    )
    xn = x / scales
    coeffs = depth_dct(xn)[:f]
    full = torch.cat([coeffs, torch.zeros(g - f, b, h, t, d, dtype=x.dtype)])
    res = xn - depth_idct(full)
    k = math.ceil(r * t)
    impact = (queries @ res.transpose(-1, -2)).abs().amax(-2) if queries is not None else res.norm(dim=-1)
    idx = impact.topk(k, dim=-1).indices.sort(-1).values
    kept = res.gather(-2, idx[..., None].expand(-1, -1, -1, -1, d))
    return DepthSplit(coeffs, idx, kept, scales, g)


def merge(s: DepthSplit) -> torch.Tensor:
    """DepthSplit -> reconstructed `[G, b, h, T, d]`."""
    f, b, h, t, d = s.coeffs.shape
    full = torch.cat([s.coeffs, torch.zeros(s.groups - f, b, h, t, d, dtype=s.coeffs.dtype)])
    x = depth_idct(full)
    x = x.scatter_add(-2, s.idx[..., None].expand(-1, -1, -1, -1, d), s.residual)
    return x * s.scales
