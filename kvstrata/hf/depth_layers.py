"""Cache layers that share K/V across a group of full-attention layers next to each other in depth
(FreqDepthKV; sliding layers in between are skipped).

transformers calls `update` one layer at a time, so the group works in blocks: every layer keeps
its newest tokens in full precision until a block of `block` tokens is complete in every layer
of the group (the group's last layer has seen them), then the block is encoded once for the
whole group. Reads decode only the asking layer's slice. Head modes are fixed by the probe at
the first encode (prefill) and reused for every later block.
"""

from __future__ import annotations

import torch

from kvstrata.codecs.depth import group_queries
from kvstrata.codecs.qtensor import held_bytes
from kvstrata.hf.layers import CompressedLayer
from kvstrata.methods import StoreRecipe
from kvstrata.read.decode import EncodedView


class DepthGroup:
    def __init__(self, recipe: StoreRecipe, members: list["DepthLayer"]):
        self.recipe = recipe
        self.cfg = recipe.depth
        self.members = members
        self.blocks: list = []
        self.state: dict = {}  # the group codec's fixed decisions (FreqDepthKV: per-head modes)
        self.queries: list[torch.Tensor | None] = [None] * len(members)

    @property
    def modes(self) -> list[str] | None:
        return self.state.get("modes")

    @property
    def encoded_tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)

    def dense(self, j: int, dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks, vs = [], []
        for block in self.blocks:
            k, v = block.layer(j, self.cfg.g, dtype)
            ks.append(k)
            vs.append(v)
        return ks, vs

    def maybe_encode(self) -> None:
        """Encode the oldest complete blocks once every member holds them (keeping `r` recent tokens)."""
        ready = min(m.keys.shape[-2] for m in self.members) - self.recipe.r
        first = not self.blocks
        n = ready if first else ready - ready % self.cfg.block  # the prefill goes in one block
        if n <= 0 or (first and n < self.cfg.block):
            return
        k = torch.stack([m.keys[..., :n, :] for m in self.members]).float()
        v = torch.stack([m.values[..., :n, :] for m in self.members]).float()
        q = None
        if all(x is not None for x in self.queries):
            q = group_queries(self.queries, k.shape[2])
        self.blocks.append(self.cfg.encode(k, v, q, self.recipe.codec, self.state))
        for m in self.members:
            m.keys = m.keys[..., n:, :].clone()
            m.values = m.values[..., n:, :].clone()

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.blocks)


class DepthLayer(CompressedLayer):
    """Member `index` of a DepthGroup; its own storage is only its full-precision tail."""

    @property
    def reads_views(self) -> bool:
        """Decode attention reads the codes when every block keeps every head exact (per-layer
        QTensors); shared / residual heads are reconstructed and attended densely."""
        return all(block.layers is not None for block in self.group.blocks)

    def view(self) -> EncodedView:
        runs = [(*block.layers[self.index], 0) for block in self.group.blocks]
        return EncodedView(key_channel=False, runs=runs, generation=self.generation)

    def __init__(self, recipe: StoreRecipe, index: int):
        super().__init__(recipe)
        self.index = index
        self.group: DepthGroup | None = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.group.dense(self.index, self.dtype)
        return torch.cat(ks + [self.keys], dim=-2), torch.cat(vs + [self.values], dim=-2)

    def _flush(self) -> None:
        if self.index == len(self.group.members) - 1:  # the group's last layer has the new tokens too
            self.group.maybe_encode()

    def set_queries(self, queries: torch.Tensor | None) -> None:
        self.group.queries[self.index] = queries

    def stored_tokens(self) -> int:
        return self.group.encoded_tokens + (self.keys.shape[-2] if self.is_initialized else 0)

    def nbytes(self) -> int:
        """The tail, plus an even share of the group's encoded blocks (the first member takes the
        remainder)."""
        if not self.is_initialized:
            return 0
        shared = self.group.nbytes()
        g = len(self.group.members)
        share = shared // g + (shared % g if self.index == 0 else 0)
        return held_bytes([self.keys, self.values]) + share

    def row_bytes(self, tokens: int = 256) -> tuple[float, float]:
        """Bytes per token's K row and V row per KV head, averaged over what this layer holds (its share
        of the group's blocks plus its tail): what a sparse read gathers per entry under sharing."""
        n = self.stored_tokens() if self.is_initialized else 0
        if n == 0:
            return super().row_bytes(tokens)
        per = self.nbytes() / n / self.keys.shape[1] / 2
        return per, per

    def reset(self) -> None:
        super().reset()
        self.group.blocks, self.group.state = [], {}
        for member in self.group.members:  # every member's encoded rows are gone
            member.generation += 1

    def _map_batch(self, fn) -> None:
        raise NotImplementedError("depth-shared caches do not support beam search or batch reordering yet")
