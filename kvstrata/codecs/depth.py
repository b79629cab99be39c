"""FreqDepthKV (arXiv 2607.06519): training-free depth sharing of K/V across adjacent layers.

A group of `g` adjacent layers is encoded jointly, one KV head at a time, in one of three modes
chosen by a probe on real queries during prefill and then fixed:
  shared   -- the `f` lowest depth-DCT coefficients only (one copy for the whole group);
  residual -- those plus each layer's high-frequency residual for the top `r` share of tokens,
              ranked by how much the residual moves attention logits;
  exact    -- every layer kept on its own.
The cheapest mode whose relative attention-output error stays within `tol` wins. Coefficients,
residual values and exact layers go through the recipe's element codec (`depth:...+nvfp4`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvstrata.codecs.base import Codec
from kvstrata.codecs.depth_dct import DepthSplit, dct_matrix, merge, split
from kvstrata.codecs.qtensor import QTensor, held_bytes

MODES = ("shared", "residual", "exact")


@dataclass(frozen=True)
class FreqDepth:
    g: int = 4
    f: int = 1
    r: float = 0.05
    tol: float = 0.1
    norm: bool = False
    block: int = 64
    #: "probe" (per head, cheapest within tol) or one mode forced on every head (for ablations)
    mode: str = "probe"
    name: ClassVar[str] = "depth"
    summary: ClassVar[str] = (
        "FreqDepthKV: DCT depth sharing over g adjacent layers + sparse residuals, per-head probe"
    )

    start: ClassVar[float] = 0.0  # groups start at the first layer

    def encode(self, k: torch.Tensor, v: torch.Tensor, queries, codec: Codec, state: dict) -> "DepthBlock":
        """`k, v: [g, b, h, T, d]`, `queries: [g, b, h, nq, d]` or None. The first call probes and
        fixes each head's mode in `state`; later blocks reuse it."""
        if "modes" not in state and self.mode != "probe":
            state["modes"] = [self.mode] * k.shape[2]
        if "modes" not in state:
            state["modes"] = [
                probe_mode(k[:, :, h : h + 1], v[:, :, h : h + 1], queries[:, :, h], self, codec)
                if queries is not None
                else "residual"
                for h in range(k.shape[2])
            ]
        return encode_block(k, v, state["modes"], self, codec, queries)

    def __post_init__(self):
        if not 2 <= self.g <= 64 or not 1 <= self.f < self.g:
            raise ValueError(f"depth: need 2 <= g <= 64 and 1 <= f < g, got g={self.g}, f={self.f}")
        if not 0.0 <= self.r <= 1.0 or not 0 <= self.tol <= 1e6 or not 1 <= self.block <= 65536:
            raise ValueError(
                f"depth: need 0 <= r <= 1, 0 <= tol <= 1e6, 1 <= block <= 65536 (got r={self.r}, "
                f"tol={self.tol}, block={self.block})"
            )
        if self.mode not in ("probe", *MODES):
            raise ValueError(f"depth: mode must be probe, {', '.join(MODES)} (got {self.mode!r})")


@dataclass
class Encoded:
    """One head's K or V of a group: packed according to its mode."""

    mode: str
    parts: dict[str, object] = field(default_factory=dict)  # QTensors and raw tensors

    def tensors(self):
        for p in self.parts.values():
            yield from (p.parts.values() if isinstance(p, QTensor) else [p])


def _encode(x: torch.Tensor, mode: str, cfg: FreqDepth, codec: Codec, queries) -> Encoded:
    """`x: [g, b, 1, T, d]` (one head) -> Encoded."""
    c = codec
    if mode == "exact":
        return Encoded(mode, {f"layer{j}": c.encode(x[j]) for j in range(x.shape[0])})
    s = split(x, cfg.f, cfg.r if mode == "residual" else 0.0, queries, cfg.norm)
    parts = {"coeffs": c.encode(s.coeffs), "scales": s.scales.float()}
    if mode == "residual":
        parts["idx"] = s.idx.to(torch.int32)
        parts["residual"] = c.encode(s.residual)
    return Encoded(mode, parts)


def _decode(e: Encoded, g: int, dtype) -> torch.Tensor:
    """Encoded -> `[g, b, 1, T, d]`."""
    if e.mode == "exact":
        return torch.stack([e.parts[f"layer{j}"].dequantize(dtype) for j in range(g)])
    coeffs = e.parts["coeffs"].dequantize(torch.float32)
    f, b, h, t, d = coeffs.shape
    if e.mode == "residual":
        idx, res = e.parts["idx"].long(), e.parts["residual"].dequantize(torch.float32)
    else:
        idx, res = torch.zeros(g, b, h, 0, dtype=torch.long), torch.zeros(g, b, h, 0, d)
    return merge(DepthSplit(coeffs, idx, res, e.parts["scales"], g)).to(dtype)


def _attention_error(q, k, v, k2, v2) -> float:
    """Max over layers of the relative attention-output error; `q: [g, b, nq, d]`, k/v: `[g, b, 1, T, d]`."""
    scale = q.shape[-1] ** -0.5
    out = lambda kk, vv: torch.softmax(q @ kk[:, :, 0].transpose(-1, -2) * scale, -1) @ vv[:, :, 0]  # noqa: E731
    o, o2 = out(k.float(), v.float()), out(k2.float(), v2.float())
    return ((o2 - o).norm(dim=(-1, -2)) / o.norm(dim=(-1, -2)).clamp(min=1e-12)).max().item()


def probe_mode(k, v, queries, cfg: FreqDepth, codec: Codec) -> str:
    """Cheapest mode within `cfg.tol` for one head (`k, v: [g, b, 1, T, d]`, `queries: [g, b, nq, d]`)."""
    for mode in MODES[:-1]:
        q = queries[:, :, None] if mode == "residual" else None
        ek = _encode(k, mode, cfg, codec, q)
        ev = _encode(v, mode, cfg, codec, None)
        err = _attention_error(
            queries, k, v, _decode(ek, cfg.g, torch.float32), _decode(ev, cfg.g, torch.float32)
        )
        if err <= cfg.tol:
            return mode
    return "exact"


@dataclass
class DepthBlock:
    """A run of `tokens` tokens of a group, every KV head encoded in its mode. When every head is
    exact the block holds, per layer, one K and one V `QTensor` of all heads (`layers`): exactly a
    per-layer cache's encoding, which decode attention reads straight from the codes."""

    tokens: int
    heads: list[tuple[Encoded, Encoded]]  # per KV head: (K, V); empty when `layers` is set
    layers: list[tuple[QTensor, QTensor]] | None = None

    def tensors(self):
        """Every tensor held."""
        if self.layers is not None:
            for qk, qv in self.layers:
                yield from qk.parts.values()
                yield from qv.parts.values()
        for ek, ev in self.heads:
            yield from ek.tensors()
            yield from ev.tensors()

    def nbytes(self) -> int:
        return held_bytes(self.tensors())

    def layer(self, j: int, g: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `j`'s K and V: `[b, kv_heads, tokens, d]` (only layer j is reconstructed)."""
        if self.layers is not None:
            return tuple(q.dequantize(dtype) for q in self.layers[j])
        ks = [_decode_layer(ek, j, g, dtype) for ek, _ in self.heads]
        vs = [_decode_layer(ev, j, g, dtype) for _, ev in self.heads]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def _decode_layer(e: Encoded, j: int, g: int, dtype) -> torch.Tensor:
    """Layer `j` of one head's Encoded -> `[b, 1, T, d]`: its low band from the shared coefficients
    plus its own residual rows, without reconstructing the other layers."""
    if e.mode == "exact":
        return e.parts[f"layer{j}"].dequantize(dtype)
    coeffs = e.parts["coeffs"].dequantize(torch.float32)  # [f, b, 1, T, d]
    basis = dct_matrix(g).to(torch.float32)[: coeffs.shape[0], j]  # column j of the inverse transform
    x = torch.tensordot(basis, coeffs, dims=([0], [0]))
    if e.mode == "residual":
        idx, res = e.parts["idx"][j].long(), e.parts["residual"].dequantize(torch.float32)[j]
        x = x.scatter_add(-2, idx[..., None].expand(-1, -1, -1, x.shape[-1]), res)
    return (x * e.parts["scales"][j]).to(dtype)


def encode_block(
    k: torch.Tensor, v: torch.Tensor, modes: list[str], cfg: FreqDepth, codec: Codec,
    queries: torch.Tensor | None,
) -> DepthBlock:
    """`k, v: [g, b, h, T, d]`; `queries: [g, b, h, nq, d]` (per KV head) ranks residual tokens."""
    if all(m == "exact" for m in modes):
        c = codec
        return DepthBlock(k.shape[-2], [], [(c.encode(k[j]), c.encode(v[j])) for j in range(k.shape[0])])
    heads = []
    for h, mode in enumerate(modes):
        q = queries[:, :, h : h + 1] if queries is not None else None
        heads.append(
            (
                _encode(k[:, :, h : h + 1], mode, cfg, codec, q),
                _encode(v[:, :, h : h + 1], mode, cfg, codec, None),
            )
        )
    return DepthBlock(k.shape[-2], heads)


def group_queries(queries: list[torch.Tensor], kv_heads: int) -> torch.Tensor:
    """Per-layer window queries `[b, q_heads, w, d]` -> `[g, b, kv_heads, q_per_kv * w, d]`."""
    out = []
    for q in queries:
        b, hq, w, d = q.shape
        out.append(q.reshape(b, kv_heads, hq // kv_heads * w, d))
    return torch.stack(out).float()
