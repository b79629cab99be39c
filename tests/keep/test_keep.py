"""Keep policies: budgets, sinks/windows, GQA-aware scores, and eviction inside the cache."""

import pytest
import torch

from kvstrata.codecs import spec_of
from kvstrata.hf import CompressedCache
from kvstrata.hf.attention import attention_implementation, set_attention_implementation
from kvstrata.hf.run import forward, generate
from kvstrata.keep import TOVA, SnapKV, StreamingLLM, window_scores
from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.protocol import build_cache, prefill


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


def test_tova_keeps_the_last_querys_most_attended_positions():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0, 2], scores[0, 0, 5] = 0.5, 0.3  # KV group 0's queries
    scores[0, 1, 7], scores[0, 1, 1] = 0.6, 0.2  # KV group 1's queries
    keys = torch.randn(1, 2, 10, 4)
    idx = TOVA(keep=0.3, heads="group").select(keys, scores)  # 3 of 10: the last and the top 2 per group
    assert idx[0, 0].tolist() == [2, 5, 9] and idx[0, 1].tolist() == [1, 7, 9]
    shared = TOVA(keep=0.3).select(keys, scores)  # all heads averaged: 7 (0.3), 2 (0.25)
    assert shared[0, 0].tolist() == shared[0, 1].tolist() == [2, 7, 9]
    with pytest.raises(ValueError, match="heads must be"):
        parse_method("tova:heads=some")


@pytest.mark.parametrize("policy, spec", [(SnapKV, "snapkv:keep=0.4,window=8"), (TOVA, "tova:keep=0.4")])
def test_a_plain_forward_keeps_what_the_bench_keeps(tiny_llama, monkeypatch, policy, spec):
    """Scores gathered by the attention hook during a model's own prefill select exactly the
    positions the benchmark's probe-and-load path selects."""
    chosen = []
    select = policy.select
    monkeypatch.setattr(policy, "select", lambda self, k, s: chosen.append(select(self, k, s)) or chosen[-1])
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(4))
    build_cache(tiny_llama, prefill(tiny_llama, ids), parse_method(spec))  # the probe's window: 32
    bench = list(chosen)
    chosen.clear()
    cache = CompressedCache(tiny_llama.config, spec)
    forward(tiny_llama, ids, cache)
    assert len(chosen) == len(bench) == tiny_llama.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(chosen, bench))
    assert cache.get_seq_length() == 60 and all(layer.stored_tokens() == 24 for layer in cache.layers)


def test_keep_policies_run_through_generate(tiny_llama):
    tok = byte_tokenizer()
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(5))
    for spec in ("snapkv:keep=0.3", "tova:keep=0.3+nvfp4", "streaming:keep=0.3"):
        g = generate(tiny_llama, tok, ids, spec, max_new_tokens=4)
        assert 1 <= len(g.new_tokens) <= 4 and g.kv_bytes_per_token < 0.5 * g.kv_bytes_per_token_bf16, spec


def test_a_model_attending_without_the_hook_is_a_clear_error(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "snapkv:keep=0.5")
    before = attention_implementation(tiny_llama.config)
    set_attention_implementation(tiny_llama.config, "sdpa")
    try:
        forward(tiny_llama, torch.randint(0, 256, (1, 20)), cache)
        with pytest.raises(RuntimeError, match="needs the prefill's attention scores"):
            forward(tiny_llama, torch.randint(0, 256, (1, 1)), cache)
    finally:
        set_attention_implementation(tiny_llama.config, before)


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
