"""A decoder layer of an encoder-decoder model (`kvstrata.models.ced`): `ProjectedLayer`.

The layer holds two things. The *projected* K/V of every position: made from the encoder's last
hidden state by the layer's projection, RoPE'd, and stored through the layer's recipe exactly as
any layer's K/V are (`inner`, a `CompressedLayer`). Its *own* K/V, computed by the layer itself,
for a window of the newest positions it has run over (`n_win`), full precision. A query at
position t reads its own K/V at positions `[max(own_start, t - n_win + 1), t]` and the projected
K/V before that (a sliding layer also stops at its window): one softmax over both (`mask`).

Each step the model first adds the projected K/V of every new position (`add_projected`), then
runs the layer over the positions it replays (`prepare`, then `update` through the cache, which
returns the projected rows followed by the own rows).

What the persistent store keeps of the decoder half (`STORED`, the config's `"store"`): "projected",
each decoder layer's projected K/V as `inner` holds them, or "hidden", `H(split)` itself (`Hidden`:
one row per position, encoded with the recipe's value codec) with the projections applied on load;
the decoder then runs on `H(split)` as decoded, so a hit and a cold run read the same rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvstrata.codecs.qtensor import held_bytes
from kvstrata.hf.held import cut
from kvstrata.hf.layers import CompressedLayer
from kvstrata.hf.segments import decode_segment
from kvstrata.methods import StoreRecipe

CONFIG_KEY = "kvstrata_ced"  # the model config's field naming an encoder-decoder's split and window
STORED = ("projected", "hidden")  # what the store keeps of the decoder half (the config's "store")


def ced_plan(text_config) -> tuple[int, int] | None:
    """(split, n_win) of an encoder-decoder model's config; None for any other model."""
    plan = getattr(text_config, CONFIG_KEY, None)
    return None if not plan else (int(plan["split"]), int(plan["n_win"]))


def _check_stored(stored: str) -> str:
    if stored not in STORED:
        raise ValueError(f"{CONFIG_KEY}.store must be one of {', '.join(STORED)}, got {stored!r}")
    return stored


def ced_config(split: int, n_win: int, store: str = STORED[0]) -> dict:
    """The config field (`CONFIG_KEY`) naming an encoder-decoder's plan; an unknown `store` is refused."""
    return {"split": split, "n_win": n_win, "store": _check_stored(store)}


def ced_stored(text_config) -> str:
    """What the store keeps of an encoder-decoder's decoder half: "projected" (the default) or "hidden"."""
    plan = getattr(text_config, CONFIG_KEY, None) or {}
    return _check_stored(plan.get("store", STORED[0]))


def stored_layer(layer) -> CompressedLayer:
    """The `CompressedLayer` that holds what a cache layer stores (a projected layer's `inner`)."""
    return layer.inner if isinstance(layer, ProjectedLayer) else layer


def hidden_recipe(recipe: StoreRecipe) -> StoreRecipe:
    """How `H(split)` is kept: the recipe's value codec, per token, nothing else."""
    return StoreRecipe(codec=recipe.value_codec)


class Hidden(CompressedLayer):
    """`H(split)` of every position, encoded with the recipe's value codec (per token, no transforms):
    one `[batch, 1, n, hidden / 2]` half as keys, the other as values, so records, seals and installs
    treat it as a full-attention layer of one head."""

    def __init__(self, recipe: StoreRecipe):
        super().__init__(hidden_recipe(recipe))

    @staticmethod
    def halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = h.shape[-1] // 2
        return h[..., :half].unsqueeze(1), h[..., half:].unsqueeze(1)

    def rows(self, start: int, n: int) -> torch.Tensor:
        """`H(split)` of positions `[start, start + n)` as held, only those decoded: `[batch, n, hidden]`."""
        part = cut(self, start, start + n, encode_tail=False)
        pairs = [decode_segment(self.recipe, seg, self.dtype) for seg in part.segments]
        pairs += [part.tail] if part.tail is not None else []
        k, v = (torch.cat([p[i] for p in pairs], dim=-2)[:, 0] for i in (0, 1))
        return torch.cat([k, v], dim=-1)

    def hold(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """Encode the rows of positions from `start` (rows already held, in a replay, are not encoded
        again) and return them as held."""
        self.append(*self.halves(h), offer=False, attend=False)
        return self.rows(start, h.shape[1])


def check_ced_method(spec) -> None:
    """Refuse what an encoder-decoder cache cannot take yet: keep policies, depth sharing, top-k reads."""
    for recipe in spec.recipes():
        for what, why in (
            (recipe.keep, "keep policies"),
            (recipe.depth, "depth sharing"),
            (recipe.read, "top-k reads"),
        ):
            if what is not None:
                raise ValueError(
                    f"method {spec.text!r}: an encoder-decoder model's cache takes codecs only, not {why}"
                )


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[1, 1, queries, keys]`: 0 where `seen: [queries, keys]` holds, the dtype's lowest elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


class ProjectedLayer(CacheLayerMixin):
    """Projected K/V for every position (`inner`) + the layer's own K/V for the newest `n_win`."""

    is_compileable = False
    is_croppable = False
    reads_views = False
    pending_keep = False
    deferred = False

    def __init__(self, inner: CompressedLayer, n_win: int):
        super().__init__()
        self.inner, self.n_win = inner, n_win
        self.is_sliding = inner.is_sliding
        self.sliding_window = getattr(inner, "sliding_window", None)
        if self.sliding_window is not None:  # the window's earliest query reads this far back
            inner.sliding_window = self.sliding_window + n_win
        self._fresh()

    def _fresh(self) -> None:
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None  # [batch, kv_heads, rows, head_dim]
        self.own_start = 0  # position of the first own row held
        self.staged: tuple[torch.Tensor, torch.Tensor, int] | None = None  # projected K, V, first position
        self.is_initialized = False

    @property
    def own_rows(self) -> int:
        return 0 if self.own is None else self.own[0].shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def add_projected(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the projected (RoPE'd) K/V of the step's new positions (nothing is read back: a prefill
        chunk whose decoder does not run reads none of them)."""
        self.inner.append(keys, values, offer=False, attend=False)

    def prepare(self, start: int, rows: int) -> None:
        """Before the layer runs over positions `[start, start + rows)`: stage the projected K/V held
        (decoded once, for this pass); drop own rows no query from `start` on reads, and own rows
        that do not end at `start` (positions were skipped) entirely."""
        k, v = self.inner.dense()
        self.staged = (k, v, self.inner.get_seq_length() - k.shape[-2])
        if self.own is None or self.own_start + self.own_rows != start:
            self.own, self.own_start = None, start
            return
        drop = max(0, start - self.n_win + 1 - self.own_start)
        if drop:
            self.own = tuple(t[..., drop:, :].clone() for t in self.own)
            self.own_start += drop

    def mask(self, start: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask `[1, 1, rows, projected + own]` of queries at `start..start+rows-1` over the
        staged projected rows, then the own rows as they will be after this step's update."""
        if self.staged is None:
            raise RuntimeError("add_projected must run before the layer's mask is built")
        t = torch.arange(start, start + rows).unsqueeze(1)
        p = torch.arange(self.staged[2], self.staged[2] + self.staged[0].shape[-2]).unsqueeze(0)
        o = torch.arange(self.own_start, start + rows).unsqueeze(0)
        bound = torch.clamp(t - self.n_win + 1, min=self.own_start)
        seen = torch.cat([p < bound, (o >= bound) & (o <= t)], dim=1)
        if self.sliding_window is not None:
            seen &= (t - torch.cat([p, o], dim=1)) < self.sliding_window
        return additive_mask(seen, dtype)

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, offer: bool = False, defer: bool = False
    ):
        """The layer's own K/V of the positions it runs over -> (staged projected K/V followed by the
        own K/V held, same for V, no view)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.staged is None:
            raise RuntimeError("a projected layer ran before its projected K/V were added")
        new = (key_states, value_states)
        self.own = (
            new if self.own is None else tuple(torch.cat([a, b], dim=-2) for a, b in zip(self.own, new))
        )
        pk, pv, _ = self.staged
        self.staged = None
        return torch.cat([pk, self.own[0]], dim=-2), torch.cat([pv, self.own[1]], dim=-2), None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values, _ = self.append(key_states, value_states)
        return keys, values

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def nbytes(self) -> int:
        """Projected K/V as the recipe stores them + the own window in full precision."""
        return self.inner.nbytes() + (held_bytes(list(self.own)) if self.own is not None else 0)

    def shrink(self) -> None:
        self.inner.shrink()

    def reset(self) -> None:
        self.inner.reset()
        self._fresh()

    def start_replay(self, position: int) -> None:
        """A replay from `position`: projected K/V held stay (rows already held are not added again;
        a sliding layer holding none rebuilds its window); the own window starts over."""
        self.inner.start_replay(position, rebuild=self.inner.stored_tokens() == 0)
        self._fresh()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "CompressedCache cannot be cropped: encoded tokens cannot be rolled back exactly"
        )
