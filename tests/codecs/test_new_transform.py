"""A key transform registered only inside a fixture -- a per-channel sign flip, defined in this file
and nowhere else -- is a recipe knob everywhere at once: the grammar parses it and renders it back,
the generated methods page documents it, dense reads, sparse reads and store records use it. No
other file is edited to get there (the invariant `kvstrata.codecs.transform` promises)."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvstrata.codecs.transform import Attend, State, Transform, per_query_head
from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, generate
from kvstrata.knobs import flag, knob, render_flag
from kvstrata.methods import parse_method, render
from kvstrata.models.tiny import byte_tokenizer
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import KVStore
from kvstrata.read.decode import decode_attention, reference_attention
from kvstrata.registry import register_transform, unregister_transform


@dataclass(frozen=True)
class SignFlip(Transform):
    """Each key channel multiplied by the sign of its prefill mean (so every channel's mean is >= 0);
    exact, so a bf16 cache reads the same with it as without."""

    flip: bool = knob(False, "key channels multiplied by the sign of their prefill mean", "0 or 1", flag,
                      render=render_flag, position=45)
    order: ClassVar[int] = 35

    def fit(self, keys: torch.Tensor) -> State:
        return {"signs": torch.where(keys.float().mean(-2, keepdim=True) < 0, -1.0, 1.0)}

    def forward(self, keys, values, state):
        return keys * state["signs"], values, {}

    def inverse_keys(self, keys, state, side):
        return (keys * state["signs"]).to(keys.dtype)

    def enter(self, a: Attend, state: State, side):
        s = state["signs"]
        a.query = a.query.float() * per_query_head(s, a.query)
        a.tail_k = a.tail_k.float() * s
        return None


@pytest.fixture
def sign_flip():
    register_transform(SignFlip)
    yield SignFlip
    unregister_transform(SignFlip)


IDS = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(7))


def test_the_grammar_takes_it_and_renders_it_back(sign_flip):
    spec = parse_method("int4:keys=channel,group=16,r=0,flip=1,rot=hadamard")
    rec = spec.full
    assert [type(t).__name__ for t in rec.transforms] == ["SignFlip", "Rotation"]  # pipeline order
    assert parse_method(render(spec)) == spec and "flip=1" in render(spec)
    assert parse_method("nvfp4:flip=0") == parse_method("nvfp4")  # off is no transform at all
    with pytest.raises(ValueError, match="flip must be 0 or 1"):
        parse_method("nvfp4:flip=2")
    with pytest.raises(ValueError, match="flip=1 does not combine with depth sharing"):
        parse_method("depth:g=2+nvfp4:flip=1")  # what every transform excludes unless it says otherwise


def test_the_generated_methods_page_documents_it(sign_flip):
    from kvstrata.cli.methods_doc import markdown

    row = next(line for line in markdown().splitlines() if line.startswith("| `flip` |"))
    assert "prefill mean" in row and "0 or 1" in row and "depth sharing" in row


def _layer_codes(cache) -> torch.Tensor:
    seg = cache.layers[0].segments[0]
    return seg.keys.codec.decode(seg.keys)


def test_dense_reads_use_it(sign_flip, tiny_llama):
    plain, flipped = (CompressedCache(tiny_llama.config, s) for s in ("bf16", "bf16:flip=1"))
    want, got = (forward(tiny_llama, IDS, c, logits_to_keep=1) for c in (plain, flipped))
    signs = flipped.layers[0].fitted.state_of(SignFlip)["signs"]
    assert (signs < 0).any()  # the state was fitted, and some channels are flipped in the codes
    torch.testing.assert_close(_layer_codes(flipped), _layer_codes(plain) * signs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for cache in (plain, flipped):  # a decode step from the codes, fused and reference
        forward(tiny_llama, IDS[:, :1], cache)
    layer = flipped.layers[1]
    view, q = layer.view(), torch.randn(1, 4, 1, layer.keys.shape[-1])
    fused = decode_attention(q, view, layer.keys, layer.values, 0.125)
    torch.testing.assert_close(fused, decode_attention(q, view, layer.keys, layer.values, 0.125, fused=False),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(fused, reference_attention(q, *layer.dense(), 0.125), atol=1e-4, rtol=0)


def test_sparse_reads_use_it(sign_flip, tiny_llama):
    tok = byte_tokenizer()
    plain, flipped = (generate(tiny_llama, tok, IDS, f"nvfp4{k}+topk:k=8,window=4", max_new_tokens=6)
                      for k in ("", ":flip=1"))
    assert flipped.new_tokens == plain.new_tokens  # a sign flip moves no NVFP4 code's magnitude
    assert flipped.cache.layers[0].fitted.state_of(SignFlip) is not None


def test_store_records_carry_it(sign_flip, tiny_gemma, tmp_path):
    store = KVStore(DiskTier(tmp_path / "g", 1 << 26), MemoryTier(1 << 24))
    server = PrefixServer(tiny_gemma, store, "nvfp4:flip=1", block_size=8)
    cold = server.serve(IDS[0].tolist())
    tensors, meta = store.get_global(sorted(store.global_tier.keys())[0], server.ns)
    assert '"flip=1"' in meta["kv"] and any(".signs" in name for name in tensors)
    warm = server.serve(IDS[0].tolist())
    assert warm.kind == "hit" and warm.reused_tokens == 64
    torch.testing.assert_close(warm.logits, cold.logits, atol=0, rtol=0)
