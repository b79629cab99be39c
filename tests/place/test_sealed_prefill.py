"""One cut rule for every way a prompt enters a cache: `kvstrata generate`, a served miss and a
served hit hold the same codes. Chunks never cross a store block boundary; at each one the cache
is sealed (its full-precision tail encoded as a record encodes it, spare rows given back), so a
prompt continued from the store runs exactly as one computed here -- for every store codec,
including the KIVI residual (`r=`), key groups along tokens and NVFP4's tensor scale."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.hf import CompressedCache
from kvstrata.hf.held import seal
from kvstrata.hf.run import decode_steps, forward, generate, prefill_spans, sealed_at, store_boundary
from kvstrata.methods import METHODS
from kvstrata.models.tiny import byte_tokenizer
from kvstrata.names import Retention
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import KVStore
from kvstrata.serve.sessions import Sessions

BLOCK, CHUNK = 8, 16
SPECS = [n for n, e in METHODS.items() if e.stratum == "store"] + [
    "int2:group=16,r=4,center=1;sliding=int4:keys=channel,group=16,r=0,sink=2",
    "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3,rot=hadamard", "nvfp4:sink=4,center=1,rot=hadamard"]


@given(n=st.integers(1, 300), chunk=st.integers(1, 64), block=st.integers(1, 40), start=st.integers(0, 300))
def test_spans_cover_the_prompt_and_never_cross_a_stored_boundary(n, chunk, block, start):
    start = min(start, n - 1)
    spans = prefill_spans(n, chunk, block, start)
    assert spans[0][0] == start and spans[-1][1] == n
    assert all(a < b <= a + chunk for a, b in spans) and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    last = store_boundary(n, block)
    assert not any(a < m < b for a, b in spans for m in range(block, last + 1, block))
    sealed = {b for a, b in spans if sealed_at(b, n, block)}
    assert sealed == {m for m in range(block, last + 1, block) if m > start}


def _fed(model, cache, ids, start, upto):
    """Feed `ids[start:upto]` into `cache` by the rule, sealed where a server seals; the last logits."""
    logits = None
    for a, b in prefill_spans(len(ids), CHUNK, BLOCK, start):
        if b > upto:
            break
        logits = forward(model, torch.tensor([ids[a:b]]), cache)[:, -1]
        if sealed_at(b, len(ids), BLOCK):
            seal(cache, BLOCK)
    return logits


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_hit_holds_and_answers_bit_for_bit_what_a_miss_does(arch, spec, tiny_llama, tiny_gemma, tmp_path):
    model = tiny_llama if arch == "llama" else tiny_gemma
    ids = torch.randint(3, 250, (61,), generator=torch.Generator().manual_seed(7)).tolist()
    longer = ids + [5, 9, 11, 13, 17, 19, 23]
    store = KVStore(DiskTier(tmp_path / "g", 1 << 26), MemoryTier(1 << 24), swa_ttl_s=300)
    server = PrefixServer(model, store, spec, block_size=BLOCK)
    server.begin(ids).run(model, CHUNK)  # a miss: blocks [0, 56) stored
    prefill = server.begin(longer)
    assert (prefill.kind, prefill.pos) == ("hit", 56)
    ref = CompressedCache(model.config, spec)
    _fed(model, ref, longer, 0, 56)
    for got, want in zip(prefill.cache.layers, ref.layers):
        assert all(torch.equal(g, w) for g, w in zip(got.dense(), want.dense()))
    hit = prefill.run(model, CHUNK)
    logits = _fed(model, ref, longer, 56, len(longer))
    assert torch.equal(hit.logits, logits)
    steps = [decode_steps(model, c, x, 6, spec) for c, x in ((hit.cache, hit.logits), (ref, logits))]
    # appends after a seal go where they go after an install; the logits agree to float rounding (a
    # hit's adjacent bf16 runs are joined into one run, summed in another order: ~1e-7 here)
    assert steps[0][0] == steps[1][0]
    torch.testing.assert_close(steps[0][1], steps[1][1], atol=1e-5, rtol=0)
    # and `generate` (cut by the same rule) answers what the hit answers, as does a server without a store
    gen = generate(model, byte_tokenizer(), torch.tensor([longer]), spec, 6, prefill_chunk=CHUNK,
                   store_block=BLOCK)
    assert gen.new_tokens == steps[0][0] and len(gen.margins) == 6
    alone = Sessions(model, spec, None, block_size=BLOCK).begin(longer, b"", Retention.PERSISTENT)
    assert torch.equal(alone.run(model, CHUNK).logits, hit.logits)


def test_generate_without_a_store_block_is_not_sealed(tiny_llama):
    """`--store-block 0`: chunks only (a server without a store); the r=4 residual stays unencoded."""
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))
    tok = byte_tokenizer()
    spec = "int2:group=16,r=4,keys=token"
    sealed = generate(tiny_llama, tok, ids, spec, 1, prefill_chunk=CHUNK, store_block=BLOCK)
    free = generate(tiny_llama, tok, ids, spec, 1, prefill_chunk=CHUNK, store_block=None)
    # sealed at 8, 16, 24, 32: the residual's tokens were encoded there, each boundary's its own run
    assert all(len(a.segments) > len(b.segments) for a, b in zip(sealed.cache.layers, free.cache.layers))
    # so the chunk after a boundary read those tokens encoded, not in full precision: other K/V
    assert not torch.equal(sealed.cache.layers[-1].dense()[0], free.cache.layers[-1].dense()[0])
