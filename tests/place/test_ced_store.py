"""An encoder-decoder model (`kvstrata retrofit`) through the persistent store, both ways it can keep
the decoder half: "projected" (each decoder layer's projected K/V; a hit reruns the encoder from the
block at or before the decoder's first row, to make its window's `H(split)`) and "hidden" (`H(split)`
once per token, the projections applied on load; the decoder runs on `H(split)` as held, so no rerun
is needed). Either way a hit is the cold run: the served logits bit for bit, the greedy tokens equal,
for prompts whose cached prefix ends before, inside and after the decoder's window."""

import copy

import pytest
import torch

from kvstrata.hf.run import decode_steps
from kvstrata.models.ced.fit import fit_projections
from kvstrata.models.ced.model import encoder_decoder
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import KVStore

BLOCK, N_WIN, SPLIT = 16, 12, 2
NEW = 5  # greedy tokens compared after each served prompt


def store() -> KVStore:
    return KVStore(MemoryTier(1 << 26), MemoryTier(1 << 24))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def projections(tiny_llama, tiny_gemma):
    """Least-squares projections of the tiny models (their quality does not matter here)."""
    out = {}
    for arch, base in (("llama", tiny_llama), ("gemma3", tiny_gemma)):
        ids = [torch.tensor([tokens(s, 64)]) for s in range(3)]
        out[arch] = fit_projections(copy.deepcopy(base), ids, [torch.tensor([tokens(9, 40)])], SPLIT)[0]
    return out


def ced(base, proj, stored: str):
    return encoder_decoder(copy.deepcopy(base).to(torch.bfloat16), proj, SPLIT, N_WIN, store=stored)


def served_tokens(model, served, method: str):
    toks, rows = decode_steps(model, served.cache, served.logits, NEW, method)
    return toks, rows


@pytest.mark.parametrize("stored", ["projected", "hidden"])
@pytest.mark.parametrize("method", ["bf16", "nvfp4", "int4:keys=channel,group=32,v=nvfp4"])
# the decoder's window starts inside the prefix, before it, after it
@pytest.mark.parametrize("extra", [3, 11, 40])
def test_a_hit_is_the_cold_run(tiny_llama, projections, stored, method, extra):
    model = ced(tiny_llama, projections["llama"], stored)
    first = tokens(1, 70)
    server = PrefixServer(model, store(), method, block_size=BLOCK)
    assert server.serve(first).kind == "miss"
    prompt = first[:64] + tokens(2, extra)
    hit = server.serve(prompt)
    cold = PrefixServer(model, store(), method, block_size=BLOCK).serve(prompt)
    assert cold.kind == "miss" and hit.reused_tokens == 64
    rerun = stored == "projected" and len(prompt) - N_WIN < 64
    assert hit.kind == ("replay" if rerun else "hit")
    # a rerun starts at the block at or before the decoder's first row, else after the prefix
    assert hit.computed_tokens == len(prompt) - ((len(prompt) - N_WIN) // BLOCK * BLOCK if rerun else 64)
    assert torch.equal(hit.logits, cold.logits)
    got = served_tokens(model, cold, method)
    want = served_tokens(model, hit, method)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=0)  # decode reads differ in summation order


@pytest.mark.parametrize("stored", ["projected", "hidden"])
def test_a_hit_with_sliding_layers_is_the_cold_run(tiny_gemma, projections, stored):
    """Tiny Gemma-3 (sliding window 16): the SWA state kept at the prefix's end is live. "hidden" keeps
    it for the encoder's sliding layers and remakes the decoder's from H(split): a hit. "projected"
    with the decoder's window inside the prefix must rerun, and rebuilds the sliding windows from the
    rerun's tokens: a replay (bounded); with the window after the prefix, a hit."""
    model = ced(tiny_gemma, projections["gemma3"], stored)
    server = PrefixServer(model, store(), "bf16", block_size=BLOCK)
    first = tokens(3, 70)
    server.serve(first)
    for extra in (40, 3):
        prompt = first[:64] + tokens(4 + extra, extra)
        hit = server.serve(prompt)
        cold = PrefixServer(model, store(), "bf16", block_size=BLOCK).serve(prompt)
        exact = stored == "hidden" or len(prompt) - N_WIN >= 64
        assert hit.kind == ("hit" if exact else "replay")
        if exact:
            assert torch.equal(hit.logits, cold.logits)


def test_hidden_records_keep_h_not_the_decoder_layers(tiny_llama, projections):
    """The "hidden" records hold the encoder's full layers and H(split) (one row per token, the value
    codec): fewer bytes than the decoder layers' projected K/V at the same codec."""
    sizes = {}
    for stored in ("projected", "hidden"):
        s = store()
        server = PrefixServer(ced(tiny_llama, projections["llama"], stored), s, "nvfp4", block_size=BLOCK)
        server.serve(tokens(5, 65))
        sizes[stored] = s.global_tier.nbytes()
    assert sizes["hidden"] < sizes["projected"]


def test_an_unknown_store_mode_is_refused(tiny_llama, projections):
    with pytest.raises(ValueError, match="store must be one of projected, hidden"):
        ced(tiny_llama, projections["llama"], "both")
