"""Fitting the decoder layers' projections in closed form: least squares from `rms(H(split))` to each
decoder layer's pre-RoPE K and V, on calibration text run through the original model.

A layer's targets are what its own attention would compute before RoPE: `k_proj` / `v_proj` of its
normed input (then `k_norm` where the model has one, as Gemma-3 does). The normal equations are
summed over every calibration token in float64, then solved once per layer with a small ridge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvstrata.models.ced.model import Projections, decoder_shape, rms


def layer_targets(layer, h: torch.Tensor, kv_heads: int, dim: int) -> torch.Tensor:
    """`[tokens, 2 * kv_heads * dim]`: a decoder layer's pre-RoPE K, then V, for its input `h: [1, n, hidden]`
    (what its attention computes before RoPE)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    k = attn.k_proj(x).view(*x.shape[:2], kv_heads, dim)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    v = attn.v_proj(x).view(*x.shape[:2], kv_heads, dim)
    if hasattr(attn, "v_norm"):
        v = attn.v_norm(v)
    return torch.cat([k.flatten(-2), v.flatten(-2)], dim=-1)[0]


def layer_inputs(model, ids: torch.Tensor, first: int) -> list[torch.Tensor]:
    """Inputs `[1, n, hidden]` of layers `first..L-1` over `ids: [1, n]` (a full-depth pass, no cache)."""
    got: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, a, kw: got.append(kw.get("hidden_states", a[0] if a else None)), with_kwargs=True
        )
        for layer in model.model.layers[first:]
    ]
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return got


@dataclass
class Normal:
    """Summed normal equations of one layer's least squares (with a bias column)."""

    xtx: torch.Tensor
    xty: torch.Tensor

    @classmethod
    def empty(cls, inputs: int, outputs: int) -> "Normal":
        return cls(torch.zeros(inputs + 1, inputs + 1, dtype=torch.float64),
                   torch.zeros(inputs + 1, outputs, dtype=torch.float64))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        self.xtx += x.T @ x
        self.xty += x.T @ y.double()

    def solve(self, ridge: float) -> torch.Tensor:
        """`[hidden + 1, outputs]`: the weights (bias last) that minimise the summed squared error."""
        lam = ridge * self.xtx.diagonal().mean()
        eye = torch.eye(self.xtx.shape[0], dtype=torch.float64)
        return torch.linalg.solve(self.xtx + lam * eye, self.xty)


def solve_least_squares(
    x: torch.Tensor, y: torch.Tensor, ridge: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight `[outputs, inputs]`, bias `[outputs]`) of `y ≈ x @ W.T + b`, as the fit computes it."""
    eq = Normal.empty(x.shape[1], y.shape[1])
    eq.add(x, y)
    w = eq.solve(ridge)
    return w[:-1].T, w[-1]


@dataclass
class FitReport:
    """What the fit saw and how well the projections reproduce each decoder layer's K and V."""

    split: int
    tokens: int
    heldout_tokens: int
    ridge: float
    #: per decoder layer, relative error ||K' - K|| / ||K|| (and V) on the held-out tokens
    key_error: list[float] = field(default_factory=list)
    value_error: list[float] = field(default_factory=list)


def fit_projections(
    model,
    fit_ids: Iterable[torch.Tensor],
    heldout_ids: Iterable[torch.Tensor],
    split: int,
    ridge: float = 1e-4,
    progress: Callable[[int], None] | None = None,
) -> tuple[Projections, FitReport]:
    """Projections for decoder layers `split..L-1` of `model`, fitted on `fit_ids` (each `[1, n]`) and
    measured on `heldout_ids`. `progress(tokens)` is called after each sequence."""
    hidden, kv_heads, dim, n_layers = decoder_shape(model.config)
    layers = model.model.layers
    outs = 2 * kv_heads * dim
    eqs = [Normal.empty(hidden, outs) for _ in range(split, n_layers)]
    seen = 0
    for ids in fit_ids:
        inputs = layer_inputs(model, ids, split)
        x = rms(inputs[0])[0]
        with torch.inference_mode():
            for eq, layer, h in zip(eqs, layers[split:], inputs):
                eq.add(x, layer_targets(layer, h, kv_heads, dim))
        seen += ids.shape[1]
        if progress is not None:
            progress(ids.shape[1])
    if not seen:
        raise ValueError("the fit needs calibration text (no tokens were given)")
    proj = Projections(hidden, kv_heads, dim, n_layers - split)  # float32 whatever the model's dtype
    with torch.no_grad():
        for lin, eq in zip(proj.maps, eqs):
            w = eq.solve(ridge)
            lin.weight.copy_(w[:-1].T)
            lin.bias.copy_(w[-1])
    report = FitReport(split, seen, 0, ridge)
    _measure(model, proj, heldout_ids, split, report)
    return proj, report


def remeasure(
    model, proj: Projections, heldout_ids: Iterable[torch.Tensor], split: int, report: FitReport
) -> None:
    """`report`'s K / V errors measured again (after the projections changed: a distillation)."""
    report.heldout_tokens = 0
    _measure(model, proj, heldout_ids, split, report)


def _measure(
    model, proj: Projections, heldout_ids: Iterable[torch.Tensor], split: int, report: FitReport
) -> None:
    """Relative K / V errors of the projections on held-out text, per decoder layer."""
    _, kv_heads, dim, n_layers = decoder_shape(model.config)
    half = kv_heads * dim
    err = torch.zeros(n_layers - split, 2, dtype=torch.float64)
    ref = torch.zeros(n_layers - split, 2, dtype=torch.float64)
    for ids in heldout_ids:
        inputs = layer_inputs(model, ids, split)
        x = rms(inputs[0]).float()
        with torch.inference_mode():
            for j, (layer, h) in enumerate(zip(model.model.layers[split:], inputs)):
                y = layer_targets(layer, h, kv_heads, dim).double()
                k, v = proj(x, j)
                got = torch.cat(
                    [k[0].transpose(0, 1).flatten(-2), v[0].transpose(0, 1).flatten(-2)], -1
                ).double()
                for c, sl in enumerate((slice(0, half), slice(half, None))):
                    err[j, c] += (got[:, sl] - y[:, sl]).pow(2).sum()
                    ref[j, c] += y[:, sl].pow(2).sum()
        report.heldout_tokens += ids.shape[1]
    rel = (err / ref.clamp_min(1e-30)).sqrt()
    report.key_error, report.value_error = rel[:, 0].tolist(), rel[:, 1].tolist()
