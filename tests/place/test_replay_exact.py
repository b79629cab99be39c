"""Replay at its boundaries on a tiny Gemma-3 (window 16; layers sliding, sliding, full, sliding: an
exact replay reruns 3 x 15 tokens for the sliding layers and block - 1 for the full layer below the
last one, from the block boundary at or before them). Property tests over random prompts, split
points (the turn ending on a block boundary or inside a block; the cached prefix just below, at and
above the replay length) and turn sequences of hits, replays and misses, each served prompt against
a cold run of it (a fresh store: a miss). A replay runs the cold run's chunks, each attending its
own K/V as computed, so a hit and an exact replay are the cold run -- for every codec: the served
logits bit for bit, the greedy tokens equal and the decode steps' logits to the summation order of
the held runs; a bounded replay that reruns less than the receptive field is an approximation whose
error stays small. Depth sharing is refused by the store
(`test_prefix_server.py::test_specs_the_store_cannot_hold_are_refused`); a top-k read (`topk:`) is
here: its decode steps read sparsely from the installed or replayed cache."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstrata.hf.run import decode_steps
from kvstrata.models.tiny import tiny_model
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import EXACT, WHOLE, PrefixServer, exact_replay_tokens
from kvstrata.place.store import KVStore

WINDOW, RECEPTIVE = 16, 45  # tiny Gemma-3's sliding window; its three sliding layers' receptive field
TOPK = "bf16+topk:k=8,window=4,sinks=2"  # decode steps read 14 of the held positions
NEW = 4  # greedy tokens compared after each served prompt
SETTINGS = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def gemma_bf16():
    """Tiny Gemma-3 in bfloat16: bf16 records hold its K/V exactly (a lossless store)."""
    return tiny_model("gemma3").to(torch.bfloat16)


def store() -> KVStore:
    return KVStore(MemoryTier(1 << 26), MemoryTier(1 << 24))


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per row of logits, in nats."""
    p, q = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def cold(model, method: str, ids: list[int], block: int):
    """The prompt served from an empty store: a full prefill."""
    served = PrefixServer(model, store(), method, block_size=block).serve(ids)
    assert served.kind == "miss"
    return served


def sliding_kv(served) -> list[torch.Tensor]:
    """Every sliding layer's held window, decoded."""
    return [torch.cat(layer.dense()) for layer in served.cache.layers if layer.is_sliding]


def test_exact_replay_length_is_the_receptive_field_of_the_sliding_windows(tiny_gemma, tiny_llama):
    assert PrefixServer(tiny_gemma, store(), n_win=EXACT).n_win == RECEPTIVE + 255  # block 256
    assert PrefixServer(tiny_gemma, store(), n_win=EXACT, block_size=5).n_win == RECEPTIVE + 4
    gemma_270m = ([("sliding", 512)] * 5 + [("full", None)]) * 3  # the last full layer is above them all
    assert exact_replay_tokens(gemma_270m, 256) == 15 * 511 + 2 * 255
    assert PrefixServer(tiny_llama, store(), n_win=EXACT).n_win == 0  # no sliding layers: nothing to replay
    # a sliding layer that fits its transform on its first tokens (centering) is rebuilt from token 0
    assert PrefixServer(tiny_gemma, store(), "nvfp4:center=1", n_win=EXACT).n_win == WHOLE
    assert PrefixServer(tiny_gemma, store(), "nvfp4:rot=hadamard", n_win=EXACT).n_win == RECEPTIVE + 255
    for bad in ("most", -1):
        with pytest.raises(ValueError, match="n_win must be"):
            PrefixServer(tiny_gemma, store(), n_win=bad)


EVENTS = st.sampled_from(["hit", "replay", "miss"])


@SETTINGS
@given(seed=st.integers(0, 2**16), block=st.sampled_from([5, 8]), first=st.integers(6, 72),
       turns=st.lists(st.tuples(st.integers(1, 24), EVENTS), min_size=1, max_size=3),
       method=st.sampled_from(["bf16", TOPK]), n_win=st.sampled_from([EXACT, WINDOW, 2 * WINDOW]))
@example(seed=1611, block=5, first=59, turns=[(24, "hit")], method="bf16", n_win=EXACT)  # runs differ
def test_turns_against_a_cold_run(gemma_bf16, seed, block, first, turns, method, n_win):
    """A conversation several turns deep, each turn a hit, a replay or a miss as its event says: a
    hit, a miss and a replay that covers the receptive field give the cold run's logits and greedy
    tokens (the first, then four decode steps) bit for bit, unless a bounded replay of part of the
    prefix came before (its blocks and window were written back: close, no longer equal)."""
    s = PrefixServer(gemma_bf16, store(), method, block_size=block, n_win=n_win)
    ids = tokens(seed, first + sum(grow for grow, _ in turns))
    length, written, exact = first, 0, True
    for grow, event in [(0, "miss"), *turns]:
        length += grow
        if event == "miss":
            s.store.global_tier.clear()
            written, exact = 0, True
        if event != "hit":
            s.store.swa_tier.clear()
        served, ref = s.serve(ids[:length]), cold(gemma_bf16, method, ids[:length], block)
        assert (served.kind, served.reused_tokens) == ((event, written) if written else ("miss", 0))
        replayed = served.computed_tokens - (length - written)  # prefix tokens run again
        exact = exact and (served.kind != "replay" or replayed == written or n_win == EXACT)
        written = (length - 1) // block * block
        if exact:
            torch.testing.assert_close(served.logits, ref.logits, atol=0, rtol=0)
            ref_tokens, ref_rows = decode_steps(gemma_bf16, ref.cache, ref.logits, NEW, method)
            got_tokens, got_rows = decode_steps(gemma_bf16, served.cache, served.logits, NEW, method)
            assert got_tokens == ref_tokens
            # decode steps read the codes in tiles that follow the held runs: a cache installed from
            # stored blocks holds other runs than the one that prefilled, so its online softmax sums
            # the same terms in another order (seed 1611, block 5, first 59, a hit after 24: 3e-3)
            torch.testing.assert_close(got_rows, ref_rows, atol=1e-2, rtol=1e-2)
        else:  # a bounded replay of part of the prefix, now or in an earlier turn: close, not equal
            error = kl(ref.logits, served.logits)
            assert torch.isfinite(error).all() and error.item() < 0.05


# first turns: cached 40 (one past a block), 45 (inside a block), 45 (a whole block held back), 50, 90
SPLITS = {"below": 41, "at": 48, "at, block-aligned": 50, "above": 53, "far above": 93}
CODECS = ["bf16", "nvfp4;sliding=fp8", "int4:keys=channel,group=16,r=0,sink=3,rot=hadamard",
          "nvfp4:sink=4,center=1,rot=hadamard"]


@pytest.mark.parametrize("method", CODECS)
@pytest.mark.parametrize("split", list(SPLITS))
def test_exact_replay_is_the_cold_run(tiny_gemma, method, split):
    """Any codec, a float32 model: the exact replay's sliding windows are the cold run's bit for bit,
    as a replay of the whole cached prefix's are, its logits and greedy steps too (to the summation
    order of the held runs); a replay starting later than the receptive field differs."""
    first, block = SPLITS[split], 5
    cached = (first - 1) // block * block
    ids = tokens(first, first)

    def replay(n_win):
        s = PrefixServer(tiny_gemma, store(), method, block_size=block, n_win=n_win)
        s.serve(ids)
        s.store.swa_tier.clear()
        served = s.serve(ids[:cached + 1])  # the window is read at once by the one token after it
        assert served.kind == "replay" and served.reused_tokens == cached
        return served, s.n_win

    (exact, n_exact), (whole, _), (short, _) = replay(EXACT), replay(10**6), replay(2 * WINDOW - 2)
    assert exact.computed_tokens == cached - max(0, cached - n_exact) // block * block + 1
    ref = cold(tiny_gemma, method, ids[:cached + 1], block)
    windows = sliding_kv(ref)
    cold_steps = decode_steps(tiny_gemma, ref.cache, ref.logits, NEW, method)
    for got in (exact, whole):
        for a, b in zip(sliding_kv(got), windows):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        # the token after the prefix reads the held codes in tiles that follow their runs (a hit's
        # too): per-token codecs sum in another order (~2e-7), block-scaled ones bit for bit
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-6, rtol=0)
        steps = decode_steps(tiny_gemma, got.cache, got.logits, NEW, method)
        assert steps[0] == cold_steps[0]
        torch.testing.assert_close(steps[1], cold_steps[1], atol=1e-5, rtol=0)
    assert (short.logits - ref.logits).abs().max().item() > 1e-5
