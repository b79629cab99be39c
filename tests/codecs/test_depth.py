"""FreqDepthKV: the head probe, block encoding in the cache, byte counts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvstrata.codecs import BF16, NVFP4
from kvstrata.codecs.depth import FreqDepth, _decode, encode_block, probe_mode
from kvstrata.codecs.qtensor import held_bytes
from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, generate
from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer

CFG = FreqDepth(g=4, f=1, r=0.1, tol=0.05)


def test_probe_picks_shared_for_equal_layers_and_exact_for_unrelated():
    torch.manual_seed(0)
    q = torch.randn(4, 1, 8, 16)
    same = torch.randn(1, 1, 1, 40, 16).expand(4, -1, -1, -1, -1).clone()
    assert probe_mode(same, same, q, CFG, BF16()) == "shared"
    unrelated = torch.randn(4, 1, 1, 40, 16)
    assert probe_mode(unrelated, torch.randn(4, 1, 1, 40, 16), q, CFG, BF16()) == "exact"


def test_probe_picks_residual_when_a_few_tokens_differ():
    torch.manual_seed(1)
    q = torch.randn(4, 1, 8, 16)
    x = torch.randn(1, 1, 1, 40, 16).expand(4, -1, -1, -1, -1).clone()
    x[2, :, :, 7] = torch.randn(16) * 5  # one token differs in one layer
    assert probe_mode(x, x.clone(), q, CFG, BF16()) == "residual"


def test_block_bytes_are_what_is_held():
    k, v = torch.randn(4, 1, 2, 30, 16), torch.randn(4, 1, 2, 30, 16)
    block = encode_block(k, v, ["shared", "residual"], CFG, NVFP4(), None)
    tensors = list(block.tensors())
    assert block.nbytes() == sum(t.numel() * t.element_size() for t in tensors) == held_bytes(tensors)
    exact = encode_block(k, v, ["exact", "exact"], CFG, BF16(), None)
    assert exact.nbytes() == 2 * 4 * 2 * 30 * 16 * 2  # K and V, 4 layers, 2 heads, bf16
    dk, dv = exact.layer(2, 4, torch.float32)
    torch.testing.assert_close(dk, k[2], atol=0.05, rtol=0.01)


@pytest.fixture(scope="module")
def deep_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_cache_groups_adjacent_layers_and_encodes_whole_blocks(deep_llama):
    cache = CompressedCache(deep_llama.config, "depth:g=4,f=1,r=0.05,block=16")
    assert [run for run, _ in cache.depth_groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # layer 8 stays per-layer
    ids = torch.randint(0, 256, (1, 120))
    forward(deep_llama, ids[:, :100], cache)
    for i in range(100, 120):
        forward(deep_llama, ids[:, i : i + 1], cache)
        for layer in cache.layers[:8]:
            assert layer.keys.shape[-2] < 16  # pending tokens never reach a whole block
            assert layer.stored_tokens() == i + 1
    total = cache.nbytes()["total"]
    held = held_bytes([t for _, g in cache.depth_groups for b in g.blocks for t in b.tensors()]
                      + [t for layer in cache.layers for t in (layer.keys, layer.values)]
                      + [t for s in cache.layers[8].segments for t in s.parts()])
    assert total == held


def test_depth_tracks_dense_and_works_in_generate(deep_llama):
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    ref = CompressedCache(deep_llama.config, "bf16")
    a = torch.cat([forward(deep_llama, ids[:, :80], ref)] + \
                  [forward(deep_llama, ids[:, i : i + 1], ref) for i in range(80, 90)], 1)
    cache = CompressedCache(deep_llama.config, "depth:g=4,f=3,r=0.5,block=8")
    b = torch.cat([forward(deep_llama, ids[:, :80], cache)] + \
                  [forward(deep_llama, ids[:, i : i + 1], cache) for i in range(80, 90)], 1)
    assert (a - b).abs().mean() < 0.05
    g = generate(deep_llama, byte_tokenizer(), ids[:, :40], "depth:g=2,block=8+nvfp4", max_new_tokens=5)
    assert len(g.new_tokens) == 5


def test_depth_spec_errors():
    with pytest.raises(ValueError, match="1 <= f < g"):
        parse_method("depth:g=4,f=4")
    with pytest.raises(ValueError, match="at most one"):
        parse_method("depth+depth:g=2")
    assert parse_method("depth:g=2+int4").full.key_axis == "token"


def test_minicache_pairs_the_deeper_half_and_is_exact_when_nothing_merges(deep_llama):
    cache = CompressedCache(deep_llama.config, "minicache:block=8")
    assert [run for run, _ in cache.depth_groups] == [[4, 5], [6, 7]]  # from the middle (layer 4 of 9) down
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))
    ref = CompressedCache(deep_llama.config, "fp8")
    exact = CompressedCache(deep_llama.config, "minicache:gamma=1.0,block=8+fp8")  # every token kept unmerged
    a = torch.cat([forward(deep_llama, ids[:, :50], ref)] + \
                  [forward(deep_llama, ids[:, i : i + 1], ref) for i in range(50, 60)], 1)
    b = torch.cat([forward(deep_llama, ids[:, :50], exact)] + \
                  [forward(deep_llama, ids[:, i : i + 1], exact) for i in range(50, 60)], 1)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=0)  # only pending-token precision differs
    merged = CompressedCache(deep_llama.config, "minicache:gamma=0.0,block=8+fp8")
    c = torch.cat([forward(deep_llama, ids[:, :50], merged)] + \
                  [forward(deep_llama, ids[:, i : i + 1], merged) for i in range(50, 60)], 1)
    assert (a - c).abs().max() > 10 * (a - b).abs().max()


def test_minicache_merged_pair_holds_one_direction():
    from kvstrata.codecs.minicache import MiniCache

    base = torch.randn(1, 3, 20, 16)
    x = torch.stack([base, 2.5 * base])  # same directions, different magnitudes
    block = MiniCache(gamma=0.0).encode(x, x, None, BF16(), {})
    k0, v1 = block.layer(0, 2, torch.float32)[0], block.layer(1, 2, torch.float32)[1]
    torch.testing.assert_close(k0, x[0], atol=0.02, rtol=0.01)  # one direction shared, magnitudes restored
    torch.testing.assert_close(v1, x[1], atol=0.05, rtol=0.01)
    assert block.nbytes() < 2 * 2 * (3 * 20 * 16 * 2)  # less than two bf16 layers of K and V


def test_forced_mode_skips_the_probe_and_bad_modes_are_refused(deep_llama):
    cache = CompressedCache(deep_llama.config, "depth:g=4,f=1,mode=shared,block=16")
    forward(deep_llama, torch.randint(0, 256, (1, 40)), cache)
    assert all(group.modes == ["shared", "shared"] for _, group in cache.depth_groups)
    with pytest.raises(ValueError, match="mode must be"):
        parse_method("depth:mode=sometimes")


def test_gemma_global_layers_group_across_the_sliding_layers_between_them():
    from transformers import Gemma3TextConfig

    from kvstrata.models.tiny import tiny_config

    base = tiny_config("gemma3").to_dict()
    base.update(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                  "sliding_attention", "full_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**base), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    cache = CompressedCache(model.config, "depth:g=2,f=1,mode=shared,block=8")
    # layer 5 is left over, sliding layers untouched
    assert [run for run, _ in cache.depth_groups] == [[1, 4]]
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(6))
    ref = CompressedCache(model.config, "bf16")
    a = torch.cat([forward(model, ids[:, :40], ref)] + [forward(model, ids[:, i : i + 1], ref)
                  for i in range(40, 50)], 1)
    b = torch.cat([forward(model, ids[:, :40], cache)] + \
                  [forward(model, ids[:, i : i + 1], cache) for i in range(40, 50)], 1)
    assert torch.isfinite(b).all() and a.shape == b.shape
    assert cache.head_modes() == {"shared": model.config.num_key_value_heads}
    assert cache.nbytes()["total"] < ref.nbytes()["total"]


def test_one_layer_of_a_block_equals_the_whole_reconstruction():
    """Reading layer j reconstructs only layer j, and equals layer j of the whole group."""
    torch.manual_seed(3)
    k, v = torch.randn(4, 1, 2, 30, 16), torch.randn(4, 1, 2, 30, 16)
    cfg = FreqDepth(g=4, f=2, r=0.2, norm=True)
    block = encode_block(k, v, ["shared", "residual"], cfg, BF16(), None)
    for j in range(4):
        ks = torch.cat([_decode(ek, 4, torch.float32)[j] for ek, _ in block.heads], 1)
        vs = torch.cat([_decode(ev, 4, torch.float32)[j] for _, ev in block.heads], 1)
        dk, dv = block.layer(j, 4, torch.float32)
        torch.testing.assert_close(dk, ks, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dv, vs, rtol=1e-5, atol=1e-5)
