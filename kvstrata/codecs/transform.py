"""Key transforms: invertible maps of K (and V) applied before the element codec, one object each.

A transform owns both halves of what it does:
- `fit`: its state (per-layer tensors such as a per-channel mean), from the first tokens a layer
  encodes, as the transforms before it left them;
- `forward`: K, V into the space the codes hold (plus per-token side parts stored beside the key
  codes, e.g. outlier channels);
- `inverse_keys` / `inverse_values`: back, for dense reads;
- `enter`: a decode step's query, full-precision tail and score bias moved into the codes' space,
  so attention reads the codes as they are (and an optional fix-up of the output on the way out).

`Fitted` is a recipe's transforms with their fitted state: it travels with the encoded segments
it describes (and so with every store record), so every consumer -- dense reads, sparse reads,
the store -- applies the same pipeline in the same order. The order is each class's `order`.
A new transform is a dataclass here or in its own module whose knobs are `kvstrata.knobs.knob`
fields (the first one switches it on) plus one `register_transform` line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import ClassVar

import torch

from kvstrata.knobs import field_knobs

State = dict[str, torch.Tensor]
#: why a key transform does not combine with depth sharing (the one place this is said)
DEPTH = "its codec encodes a group of layers at once and takes no per-layer transform"


def per_query_head(t: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`t: [b, kv_heads, ...]` repeated along dim 1 to `query`'s heads (grouped-query attention)."""
    return t.repeat_interleave(query.shape[1] // t.shape[1], 1)


@dataclass(kw_only=True)
class Attend:
    """One decode step on its way into the codes' space: `query: [b, hq, 1, d]`, the full-precision
    tail `tail_k, tail_v: [b, hk, t, d]`, `bias: [b, hq, n]` added to the scores before scaling
    (n: every visible token, codes then tail), the softcap, and n."""

    query: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    tokens: int


@dataclass(frozen=True)
class Transform:
    """Base: the identity. Subclasses are frozen dataclasses whose fields are knobs."""

    order: ClassVar[int] = 100  # place in the pipeline: lower runs first on encode
    acts_on_values: ClassVar[bool] = False  # whether `forward` changes V too (not only K)
    #: names of per-token parts `forward` stores beside the key codes (`[b, h, n, ...]`)
    side: ClassVar[tuple[str, ...]] = ()
    #: conditions (`kvstrata.methods.CONDITIONS`) this transform does not combine with, and why
    excludes: ClassVar[Mapping[str, str]] = MappingProxyType({"depth": DEPTH})

    @property
    def active(self) -> bool:
        """Whether its switch (the first knob) is on: `smooth=0` is no smoothing at all."""
        first = fields(self)[0]
        return getattr(self, first.name) != first.default

    def check(self, kv_heads: int, head_dim: int) -> None:
        """Refuse a model shape this transform cannot work on (before anything runs)."""

    def check_state(self, state: State, head_dim: int) -> None:
        """Refuse (ValueError) a state this transform could not have fitted -- read from outside, e.g.
        a store record: by default every floating-point tensor must be finite."""
        for name, t in state.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"{type(self).__name__} state {name} holds NaN or Inf")

    def fit(self, keys: torch.Tensor) -> State:
        """State from `keys: [b, h, n, d]` (the first encoded tokens, earlier transforms applied)."""
        return {}

    def forward(self, keys: torch.Tensor, values: torch.Tensor, state: State):
        """K, V `[b, h, n, d]` -> (K, V in the codes' space, side parts)."""
        return keys, values, {}

    def inverse_keys(self, keys: torch.Tensor, state: State, side: State) -> torch.Tensor:
        return keys

    def inverse_values(self, values: torch.Tensor, state: State) -> torch.Tensor:
        return values

    def enter(self, a: Attend, state: State, side: Callable[[str], torch.Tensor]):
        """Move `a` into the codes' space (in place); returns a fix-up of the output `[b, hq, d]`,
        or None. `side(name)`: that side part of every visible encoded token, `[b, h, n_codes, ...]`, or
        None while no token is encoded."""
        return None


def text_of(t: Transform) -> str:
    """`t` as spec knobs (`rot=hadamard,rotseed=3`): its switch, then fields off their defaults."""
    out = []
    for i, (f, k) in enumerate(field_knobs(type(t))):
        value = getattr(t, f.name)
        if i == 0 or value != f.default:
            out.append(f"{k.key}={k.render(value)}")
    return ",".join(out)


@dataclass(frozen=True, eq=False)
class Fitted:
    """A recipe's transforms (in order) with their fitted state, one dict per transform. Compared by
    identity; `same_as` compares transforms and state."""

    transforms: tuple[Transform, ...] = ()
    states: tuple[State, ...] = ()

    @classmethod
    def fit(cls, transforms: tuple[Transform, ...], keys: torch.Tensor) -> "Fitted":
        """Fit each transform on `keys: [b, h, n, d]` as the ones before it leave them."""
        states, k = [], keys
        for t in transforms:
            states.append(t.fit(k))
            k = t.forward(k, k[..., :0, :], states[-1])[0]
        return cls(tuple(transforms), tuple(states))

    def forward(self, keys: torch.Tensor, values: torch.Tensor):
        """K, V -> the codes' space and every transform's side parts."""
        side: State = {}
        for t, s in zip(self.transforms, self.states):
            keys, values, extra = t.forward(keys, values, s)
            side.update(extra)
        return keys, values, side

    def inverse_keys(self, keys: torch.Tensor, side: State) -> torch.Tensor:
        for t, s in zip(reversed(self.transforms), reversed(self.states)):
            keys = t.inverse_keys(keys, s, side)
        return keys

    def inverse_values(self, values: torch.Tensor) -> torch.Tensor:
        for t, s in zip(reversed(self.transforms), reversed(self.states)):
            values = t.inverse_values(values, s)
        return values

    def state_of(self, cls: type) -> State | None:
        """The fitted state of the transform of class `cls`, or None when the pipeline has none."""
        return next((s for t, s in zip(self.transforms, self.states) if isinstance(t, cls)), None)

    @property
    def side(self) -> tuple[str, ...]:
        return tuple(name for t in self.transforms for name in t.side)

    def enter(self, a: Attend, side: Callable[[str], torch.Tensor]) -> list:
        """Move a decode step into the codes' space; the output fix-ups, to apply in reverse."""
        fixes = [t.enter(a, s, side) for t, s in zip(self.transforms, self.states)]
        return [f for f in fixes if f is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self.states for t in s.values()]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Fitted":
        """The same transforms with `fn` applied to every state tensor (batch reordering)."""
        return Fitted(self.transforms, tuple({k: fn(v) for k, v in s.items()} for s in self.states))

    def same_as(self, other: "Fitted") -> bool:
        """Same transforms and bit-identical state (what lets encoded runs share one read)."""
        if self.transforms != other.transforms or len(self.states) != len(other.states):
            return False
        return all(a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
                                                 and torch.equal(a[k], b[k]) for k in a)
                   for a, b in zip(self.states, other.states))

    def digest(self) -> str:
        """SHA-256 over the transforms' knobs and every state tensor's shape, dtype and bytes."""
        h = hashlib.sha256()
        for t, s in zip(self.transforms, self.states):
            h.update(f"{type(t).__name__}:{text_of(t)};".encode())
            for name in sorted(s):
                v = s[name].detach().cpu().contiguous()
                h.update(f"{name}{tuple(v.shape)}{v.dtype};".encode())
                h.update(v.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


IDENTITY = Fitted()
