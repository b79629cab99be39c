"""Keep policies: budgets, sinks/windows, GQA-aware scores, and eviction inside the cache."""

import pytest
import torch

from kvstrata.codecs import spec_of
from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward
from kvstrata.keep import SnapKV, StreamingLLM, window_scores
from kvstrata.methods import parse_method


def test_streaming_keeps_sinks_and_recent():
    keys = torch.randn(1, 2, 100, 8)
    idx = StreamingLLM(keep=0.2, sinks=4).select(keys, None)
    assert idx.shape == (1, 2, 20)
    assert idx[0, 0].tolist() == [0, 1, 2, 3] + list(range(84, 100))


def test_snapkv_picks_attended_positions_and_window():
    n = 64
    scores = torch.zeros(1, 1, n)
    scores[0, 0, 10] = 5.0
    idx = SnapKV(keep=0.25, window=8, pool=3).select(torch.randn(1, 1, n, 4), scores)
    kept = idx[0, 0].tolist()
    assert len(kept) == 16
    assert set(range(56, 64)) <= set(kept)  # the window
    assert {9, 10, 11} <= set(kept)  # the hit and its pooled neighbours
    assert kept == sorted(kept)


def test_window_scores_average_query_heads_per_kv_group():
    attn = torch.zeros(1, 4, 2, 5)
    attn[0, 0, :, 1] = 1.0  # query head 0 (group 0) looks at position 1
    attn[0, 3, :, 4] = 1.0  # query head 3 (group 1) looks at position 4
    s = window_scores(attn, kv_heads=2)
    assert s.shape == (1, 2, 5)
    assert s[0, 0].argmax() == 1 and s[0, 1].argmax() == 4


def test_snapkv_without_scores_is_a_clear_error(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "snapkv:keep=0.5")
    with pytest.raises(ValueError, match="observation-window attention"):
        forward(tiny_llama, torch.randint(0, 256, (1, 20)), cache)


def test_bad_keep_params():
    with pytest.raises(ValueError, match="keep must be a fraction"):
        parse_method("streaming:keep=1.5")
    with pytest.raises(ValueError, match="at most one"):
        parse_method("streaming+snapkv")
    m = parse_method("snapkv:keep=0.3+nvfp4")
    assert spec_of(m.full.codec) == "nvfp4" and spec_of(m.full.keep) == "snapkv:keep=0.3"


def test_keep_everything_equals_the_bf16_store(tiny_llama):
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
    ref = CompressedCache(tiny_llama.config, "bf16")
    a = [forward(tiny_llama, ids[:, :40], ref)] + [forward(tiny_llama, ids[:, i : i + 1], ref)
                 for i in range(40, 50)]
    cache = CompressedCache(tiny_llama.config, "streaming:keep=1.0")
    b = [forward(tiny_llama, ids[:, :40], cache)] + [forward(tiny_llama, ids[:, i : i + 1], cache)
                 for i in range(40, 50)]
    torch.testing.assert_close(torch.cat(b, 1), torch.cat(a, 1), rtol=0, atol=0)


def test_eviction_holds_fewer_tokens_and_keeps_causality(tiny_llama):
    """After eviction a multi-token question must still be causal: its first token's logits may not
    depend on later question tokens."""
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    def question_logits(q):
        cache = CompressedCache(tiny_llama.config, "streaming:keep=0.25")
        forward(tiny_llama, ids, cache)
        assert all(layer.stored_tokens() == 15 for layer in cache.layers)
        assert cache.get_seq_length() == 60
        return forward(tiny_llama, q, cache, logits_to_keep=q.shape[1])
    q1 = torch.tensor([[5, 6, 7]])
    q2 = torch.tensor([[5, 9, 9]])
    torch.testing.assert_close(question_logits(q1)[:, 0], question_logits(q2)[:, 0])
