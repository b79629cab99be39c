"""One store record per chunk of a vLLM request's tokens: every attention layer's K and V of those
positions, encoded with the method's store recipe and held as our own server's records hold a
block (`kvstrata.place.block_format`: sink rows in bf16, encoded segments with their transform
state), so every check `unpack` makes -- names, shapes, dtypes, codec, transform digest, token
count -- applies to what vLLM loads. No vLLM import: the connector hands token-major tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.codecs.transform import Fitted
from kvstrata.hf.held import Held
from kvstrata.hf.segments import decode_segment, encode_segment
from kvstrata.methods import MethodSpec, StoreRecipe, check_store, parse_method, render
from kvstrata.place.block_format import pack, unpack
from kvstrata.place.records import decode_record, encode_record

#: the dtype chunks are encoded from (an exact widening of the engine's bf16 / fp16), as our own
#: cache encodes float32 K/V: transform state and record dtypes are the same whatever the engine
AT_REST = torch.float32
#: what `method = "lossless"` stores: the engine's own bf16 values, bit for bit
LOSSLESS = "lossless"


@dataclass(frozen=True)
class ChunkCodec:
    """How a model's chunks are held at rest: one recipe per attention layer (by index)."""

    spec: MethodSpec
    recipes: dict[int, StoreRecipe]
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def build(cls, method: str, layer_classes: list[str], kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> "ChunkCodec":
        """`method`: a store spec (`nvfp4`, `int4:keys=channel,...`) or "lossless" (bf16 as the engine
        holds it; refused for another engine dtype, where it would not be lossless)."""
        if method == LOSSLESS:
            if dtype != torch.bfloat16:
                raise ValueError(f"method 'lossless' keeps bf16 KV as it is: the engine runs {dtype}; run it "
                                 "with dtype bfloat16 or name a store method")
            method = "bf16"
        spec = parse_method(method)
        check_store(spec)
        for rec in spec.recipes():
            if rec.read is not None:
                raise ValueError(f"{method!r}: top-k reads are a decode-time stratum; the store holds "
                                 "K/V only")
        recipes = {i: spec.recipe(kind, i) for i, kind in enumerate(layer_classes)}
        return cls(spec=spec, recipes=recipes, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)

    @property
    def text(self) -> str:
        """The canonical spec (part of the records' namespace)."""
        return render(self.spec)

    def encode(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], start: int) -> tuple[dict, dict]:
        """Per layer K, V `[kv_heads, n, head_dim]` of positions [start, start + n) (any of the model's
        layers) -> record tensors and string metadata."""
        held, n = {}, None
        for i, (k, v) in layers.items():
            n = k.shape[-2]
            held[i] = _held(self.recipes[i], k.unsqueeze(0).to(AT_REST), v.unsqueeze(0).to(AT_REST), start)
        return pack(held, tokens=n)

    def decode(self, tensors: dict, meta: dict, start: int, tokens: int,
               layers: tuple[int, ...] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A record of positions [start, start + tokens) holding exactly `layers` (default: all) -> per
        layer K, V `[kv_heads, tokens, head_dim]` in the engine's dtype; raises `RecordError` for
        anything that is not exactly such a record."""
        recipes = self.recipes if layers is None else {i: self.recipes[i] for i in layers}
        held = unpack(recipes, tensors, meta, kv_heads=self.kv_heads, head_dim=self.head_dim,
                      dtype=AT_REST, start=start, tokens=tokens)
        return {i: _dense(self.recipes[i], h, self.dtype) for i, h in held.items()}

    def warm(self, layers: tuple[int, ...], tokens: int, secret: bytes) -> None:
        """One chunk of random K/V of `layers` through the whole load path -- encode, sign, verify, parse,
        decode -- so a process's first hit pays none of its one-time costs (nothing is kept)."""
        if not layers:
            return
        kv = torch.randn(self.kv_heads, tokens, self.head_dim, generator=torch.Generator().manual_seed(0))
        tensors, meta = self.encode({i: (kv.to(self.dtype), kv.to(self.dtype)) for i in layers}, 0)
        blob = encode_record(tensors, meta, key="warm", secret=secret)
        self.decode(*decode_record(blob, key="warm", secret=secret), start=0, tokens=tokens, layers=layers)


def _held(recipe: StoreRecipe, k: torch.Tensor, v: torch.Tensor, start: int) -> Held:
    """Positions [start, start + n) as a store record holds them: the recipe's sink rows in bf16, the
    rest one segment encoded through transforms fitted on it."""
    n = k.shape[-2]
    s = max(0, min(recipe.sink - start, n))
    held = Held()
    if s:
        held.sink = (k[..., :s, :].to(torch.bfloat16), v[..., :s, :].to(torch.bfloat16))
    if s < n:
        rest_k, rest_v = k[..., s:, :], v[..., s:, :]
        held.fitted = Fitted.fit(recipe.transforms, rest_k)
        held.segments.append(encode_segment(recipe, rest_k, rest_v, held.fitted))
    return held


def _dense(recipe: StoreRecipe, held: Held, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [held.sink] if held.sink is not None else []
    parts += [decode_segment(recipe, seg, AT_REST) for seg in held.segments]
    k = torch.cat([p[0].to(dtype) for p in parts], -2)
    v = torch.cat([p[1].to(dtype) for p in parts], -2)
    return k[0], v[0]
