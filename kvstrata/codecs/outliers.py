"""Outlier key channels kept apart (the dense-and-sparse split of KVQuant and LLM.int8()).

A few key channels per head carry magnitudes far above the rest, so in a per-token block they set
the scale every other channel is quantized with. Per layer and KV head, the `c` channels with the
largest prefill key magnitude are stored beside the codes (in bf16, or in FP8 E4M3 for half the
bytes), and the codes hold the keys with those channels zeroed. Attention then splits
`q.k = q_rest . k_codes + q_out . k_out`: the codes are read with the outlier channels of the
query zeroed, and the second term is a score bias computed from the kept channels. Values are not
split (their channels carry no such outliers).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch

from kvstrata.codecs.transform import DEPTH, Attend, State, Transform
from kvstrata.knobs import choice, integer, knob

#: formats the kept channels can be stored in (`ofmt=`): bf16, or FP8 E4M3 held as its bytes (as
#: codecs.fp8 holds its codes, so every part op works on them), saturating at +-448
KEPT_FORMATS = ("bf16", "fp8")
FP8_MAX = 448.0


def store_kept(x: torch.Tensor, fmt: str = "bf16") -> torch.Tensor:
    """Kept channels -> their stored form (`fmt` in KEPT_FORMATS)."""
    if fmt == "fp8":
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return x.to(torch.bfloat16)


def kept_values(kept: torch.Tensor) -> torch.Tensor:
    """Stored kept channels (bf16, or FP8 bytes) -> float32."""
    return kept.view(torch.float8_e4m3fn).float() if kept.dtype == torch.uint8 else kept.float()


def outlier_channels(keys: torch.Tensor, count: int) -> torch.Tensor:
    """`keys: [b, h, n, d]` -> `[b, h, count]` int64: the channels of largest magnitude over the
    tokens, in ascending channel order."""
    if not 0 < count < keys.shape[-1]:
        raise ValueError(f"outliers={count} must be between 1 and head_dim - 1 ({keys.shape[-1] - 1})")
    top = keys.float().abs().amax(-2).topk(count, -1).indices
    return top.sort(-1).values


def _expand(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`idx: [b, h, c]` broadcast over the token axis of `like: [b, h, n, d]` -> `[b, h, n, c]`."""
    return idx[..., None, :].expand(*like.shape[:-1], idx.shape[-1])


def channels(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The `idx` channels of `keys: [b, h, n, d]` -> `[b, h, n, c]`, in keys' dtype."""
    return keys.gather(-1, _expand(idx, keys))


def split_outliers(
    keys: torch.Tensor, idx: torch.Tensor, fmt: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys: [b, h, n, d]` -> (keys with the `idx` channels zeroed, those channels `[b, h, n, c]`
    stored in `fmt`)."""
    return keys.scatter(-1, _expand(idx, keys), 0.0), store_kept(channels(keys, idx), fmt)


def merge_outliers(keys: torch.Tensor, kept: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_outliers`: the kept channels `[b, h, n, c]` (as stored) written back."""
    return keys.scatter(-1, _expand(idx, keys), kept_values(kept).to(keys.dtype))


def zero_channels(query: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`query: [b, hq, t, d]` with the outlier channels of its KV group zeroed."""
    per_head = idx.repeat_interleave(query.shape[1] // idx.shape[1], 1)
    return query.scatter(-1, _expand(per_head, query), 0.0)


def score_bias(query: torch.Tensor, idx: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`q_out . k_out` for every token: `query: [b, hq, 1, d]`, `kept: [b, hk, n, c]` -> `[b, hq, n]`
    float32 (added to the scores before scaling); the query heads of a KV group share its channels."""
    b, hq, _, d = query.shape
    hk = idx.shape[1]
    grouped = query.float().reshape(b, hk, hq // hk, d)  # [b, hk, groups, d]
    q_out = grouped.gather(-1, idx[:, :, None, :].expand(b, hk, hq // hk, idx.shape[-1]))
    return (q_out @ kept.float().transpose(-1, -2)).reshape(b, hq, -1)


@dataclass(frozen=True)
class Outliers(Transform):
    outliers: int = knob(
        0, "per layer and KV head the c key channels of largest prefill magnitude are held beside the "
        "codes (which hold the keys with them zeroed); attention adds their q.k as a score bias, in the "
        "fused kernel too; 2c bytes per token and KV head in bf16, counted", "[0, 256]", integer(0, 256),
        position=70)
    ofmt: str = knob(
        "bf16", "what the kept channels are stored in: fp8 (E4M3, saturating at +-448) is c bytes per "
        "token and KV head", ", ".join(KEPT_FORMATS), choice(*KEPT_FORMATS), position=71, needs="outliers")
    order: ClassVar[int] = 30
    side: ClassVar[tuple[str, ...]] = ("outliers",)
    excludes: ClassVar = MappingProxyType({
        "depth": DEPTH,
        "keys=channel": "keys grouped per channel already scale each channel apart (outliers needs "
                        "keys=token)",
    })

    def check(self, kv_heads: int, head_dim: int) -> None:
        if self.outliers >= head_dim:
            raise ValueError(f"the method keeps {self.outliers} outlier channels; the model's head_dim is "
                             f"{head_dim}")

    def check_state(self, state: State, head_dim: int) -> None:
        idx = state["idx"]
        if idx.shape[-1] != self.outliers or not ((idx >= 0) & (idx < head_dim)).all() or \
                (idx.shape[-1] > 1 and not (idx.diff(dim=-1) > 0).all()):
            raise ValueError(f"Outliers state idx must hold {self.outliers} ascending channels in "
                             f"[0, {head_dim}) per head")

    def fit(self, keys: torch.Tensor) -> State:
        return {"idx": outlier_channels(keys, self.outliers)}

    def forward(self, keys, values, state):
        keys, kept = split_outliers(keys, state["idx"], self.ofmt)
        return keys, values, {"outliers": kept}

    def inverse_keys(self, keys, state, side):
        return merge_outliers(keys, side["outliers"], state["idx"])

    def enter(self, a: Attend, state: State, side):
        c = state["idx"]
        held = side("outliers")  # None while nothing is encoded yet
        kept = channels(a.tail_k, c).float()
        kept = kept if held is None else torch.cat([kept_values(held), kept], -2)
        extra = score_bias(a.query, c, kept)
        a.query = zero_channels(a.query, c)
        a.bias = extra if a.bias is None else a.bias + extra
        return None
