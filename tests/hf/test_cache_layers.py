"""Residual window, sliding windows, KIVI axes and per-layer-class codecs."""

import pytest
import torch

from kvstrata.codecs import get_codec
from kvstrata.hf import CompressedCache
from kvstrata.hf.attention import fit_mask
from kvstrata.hf.layers import CompressedLayer, CompressedSlidingLayer
from kvstrata.hf.run import forward
from kvstrata.methods import parse_method


def kv(n, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)


@pytest.mark.parametrize("r", [0, 1, 7, 64])
def test_residual_tokens_stay_exact(r):
    layer = CompressedLayer(parse_method(f"mxfp4:r={r}").full)
    k, v = kv(20)
    layer.update(k[..., :13, :], v[..., :13, :])
    layer.update(k[..., 13:, :], v[..., 13:, :])
    dk, dv = layer.dense()
    kept = min(r, 20)
    assert layer.keys.shape[-2] == kept
    if kept:
        assert torch.equal(dk[..., -kept:, :], k[..., -kept:, :])
    enc = 20 - kept
    if enc:
        assert not torch.equal(dk[..., :enc, :], k[..., :enc, :])
        torch.testing.assert_close(dk[..., :enc, :], get_codec("mxfp4").encode(k[..., :enc, :]).dequantize())


def test_update_returns_new_tokens_in_full_precision():
    layer = CompressedLayer(parse_method("int2:r=0,group=8").full)
    k, v = kv(16)
    rk, rv = layer.update(k, v)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_kivi_axes_keys_per_channel_values_per_token():
    recipe = parse_method("int2:group=8,r=0").full
    assert recipe.key_axis == "channel" and recipe.key_group == 8
    layer = CompressedLayer(recipe)
    k, v = kv(29)
    layer.update(k[..., :21, :], v[..., :21, :])
    # the prefill is encoded whole: two key groups along tokens and a ragged third of 5 tokens
    assert layer.keys.shape[-2] == 0
    seg = layer.segments[0]
    assert seg.keys.shape == (1, 2, 32, 21)  # transposed: groups run along tokens
    assert seg.keys.parts["codes"].shape[-2] == 3 and seg.values.shape == (1, 2, 21, 32)
    # the ragged group was padded with its last token: it decodes as a group of those 5 alone
    alone = get_codec("int2:group=8").encode(k[..., 16:21, :].transpose(-1, -2)).dequantize()
    torch.testing.assert_close(layer.dense()[0][..., 16:21, :], alone.transpose(-1, -2))
    # later tokens wait in full precision until a whole group is there
    for i in range(21, 29):
        layer.update(k[..., i : i + 1, :], v[..., i : i + 1, :])
        assert layer.keys.shape[-2] == (i - 20) % 8
    assert [s.length for s in layer.segments] == [21, 8]
    assert parse_method("int2:group=8,r=0,keys=token").full.key_group == 1


@pytest.mark.parametrize("spec", ["fp8", "nvfp4:r=3", "int2:group=8,r=2", "mxfp4:r=40"])
def test_sliding_layer_keeps_only_its_window(spec):
    window = 16
    layer = CompressedSlidingLayer(parse_method(spec).full, window)
    k, v = kv(50)
    full_k = []
    for i in range(0, 50, 7):
        rk, _ = layer.update(k[..., i : i + 7, :], v[..., i : i + 7, :])
        seen = min(i + 7, 50)
        assert layer.stored_tokens() == min(seen, window - 1)
        kv_len, offset = layer.get_mask_sizes(1)
        assert kv_len == layer.stored_tokens() + 1 and offset == max(seen - window + 1, 0)
        full_k.append(rk)
    # what is returned for attention ends with the newest keys exactly
    assert torch.equal(full_k[-1][..., -1:, :], k[..., 49:50, :])
    dk, _ = layer.dense()
    assert dk.shape[-2] == window - 1
    torch.testing.assert_close(dk, k[..., -(window - 1) :, :], atol=1.5,
                               rtol=0)  # encoded, but the right tokens


def test_sliding_layer_frees_memory():
    layer = CompressedSlidingLayer(parse_method("fp8").full, 16)
    k, v = kv(400)
    layer.update(k, v)
    small = CompressedSlidingLayer(parse_method("fp8").full, 16)
    small.update(k[..., -15:, :], v[..., -15:, :])
    assert layer.nbytes() == small.nbytes()


def test_per_layer_class_codecs(tiny_gemma):
    cache = CompressedCache(tiny_gemma.config, "nvfp4;sliding=fp8:r=2")
    forward(tiny_gemma, torch.randint(0, 256, (1, 30)), cache)
    specs = [(layer.is_sliding, layer.segments[0].keys.spec, layer.recipe.r) for layer in cache.layers]
    assert specs == [(True, "fp8", 2), (True, "fp8", 2), (False, "nvfp4", 0), (True, "fp8", 2)]


def test_cache_cannot_be_cropped_silently(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "fp8")
    forward(tiny_llama, torch.randint(0, 256, (1, 10)), cache)
    with pytest.raises(NotImplementedError):
        cache.crop(-2)


@pytest.mark.parametrize("spec", ["int2:group=8,r=4", "nvfp4:r=3", "bf16"])
def test_read_prefix_rows_never_change_within_a_generation(spec):
    """The contract the sparse reader's index cache relies on: the rows an update reports as coming
    from encoded storage are returned bit-identical by every later update of the same generation."""
    layer = CompressedLayer(parse_method(spec).full)
    k, v = kv(60)
    seen = []
    for a, b in [(0, 30)] + [(i, i + 1) for i in range(30, 60)]:
        rk, _ = layer.update(k[..., a:b, :], v[..., a:b, :])
        gen, n = layer.read_prefix
        for old_gen, old_n, old_k in seen:
            if old_gen == gen:
                assert torch.equal(rk[..., :old_n, :], old_k[..., :old_n, :])
        seen.append((gen, n, rk))
    assert seen[-1][1] > seen[1][1]  # encoded storage grew during decoding (not a vacuous check)


def test_rewrites_bump_the_generation(tiny_llama):
    layer = CompressedLayer(parse_method("int4:r=0").full)
    k, v = kv(16)
    layer.update(k, v)
    before = layer.generation
    layer.reorder_cache(torch.tensor([0]))
    assert layer.generation > before
    before = layer.generation
    layer.reset()
    assert layer.generation > before
    before = layer.generation
    layer.load_prefill(k, v, 16)
    assert layer.generation > before
    sliding = CompressedSlidingLayer(parse_method("nvfp4:r=0").full, sliding_window=8)
    sliding.update(k[..., :7, :], v[..., :7, :])
    before = sliding.generation
    sliding.update(k[..., 7:9, :], v[..., 7:9, :])  # the window drops encoded rows
    assert sliding.generation > before


def test_per_layer_assignment_reaches_each_layer(tiny_gemma):
    cache = CompressedCache(tiny_gemma.config, "nvfp4;sliding=fp8;layers[1]=mxfp4;layers[2]=bf16")
    forward(tiny_gemma, torch.randint(0, 256, (1, 40)), cache)
    assert [layer.segments[0].keys.spec for layer in cache.layers] == ["fp8", "mxfp4", "bf16", "fp8"]
    with pytest.raises(ValueError, match="assigns layer 4; the model has 4 layers"):
        CompressedCache(tiny_gemma.config, "layers[4]=fp8")


@pytest.mark.parametrize("spec", ["bf16;layers[0]=streaming:keep=0.5", "bf16;layers[1,3]=tova:keep=0.5",
                                  "tova:keep=0.5;layers[2]=bf16"])
def test_layers_holding_different_counts_attend_with_their_own_mask(tiny_llama, spec):
    """Keep policies on some layers only: the mask the model builds from layer 0's sizes is aligned
    per layer, so a question fed at once gives the logits of feeding it token by token."""
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    q = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    outs = []
    for at_once in (True, False):
        cache = CompressedCache(tiny_llama.config, spec)
        forward(tiny_llama, ids, cache)
        if at_once:
            outs.append(forward(tiny_llama, q, cache, logits_to_keep=8))
        else:
            outs.append(torch.cat([forward(tiny_llama, q[:, i : i + 1], cache) for i in range(8)], 1))
        assert len({layer.stored_tokens() for layer in cache.layers}) == 2
    torch.testing.assert_close(outs[0], outs[1], atol=3e-4, rtol=0)  # new tokens: bf16-rounded once held


def test_fit_mask_keeps_the_causal_columns_next_to_the_queries():
    causal = torch.ones(3, 7, dtype=torch.bool).tril(4)[None, None]  # 4 held entries, 3 queries
    short = fit_mask(causal, 5)  # a layer holding 2 entries
    assert torch.equal(short[0, 0], torch.ones(3, 5, dtype=torch.bool).tril(2))
    long = fit_mask(causal, 9)  # a layer holding 6
    assert torch.equal(long[0, 0], torch.ones(3, 9, dtype=torch.bool).tril(6))
    assert fit_mask(causal, 7) is causal and fit_mask(None, 3) is None


@pytest.mark.parametrize("spec", ["nvfp4", "int4:r=0", "fp8:block=32", "int2:group=16,r=8",
                                  "nvfp4;sliding=fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_a_step_encodes_its_layers_at_its_end_as_each_would_alone(spec, arch, tiny_llama, tiny_gemma,
                                                                  monkeypatch):
    """A decode step leaves every layer's encoding to its last layer (one codec call per recipe):
    after each forward nothing is left pending, and logits and held codes equal those of layers
    that encode as they append."""
    model = tiny_llama if arch == "llama" else tiny_gemma
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))

    def run():
        cache = CompressedCache(model.config, spec)
        logits = [forward(model, ids[:, :40], cache)]
        for t in range(40, 60):
            logits.append(forward(model, ids[:, t:t + 1], cache))
            assert not any(getattr(layer, "deferred", False) for layer in cache.layers)
        parts = [t for layer in cache.layers for seg in layer.segments for t in seg.parts()]
        return torch.cat([x.flatten() for x in logits]), parts, cache.nbytes()["total"]

    together = run()
    append = CompressedLayer.append
    monkeypatch.setattr(CompressedLayer, "append",
                        lambda self, k, v, offer, defer=False: append(self, k, v, offer, False))
    alone = run()
    assert torch.equal(together[0], alone[0]) and together[2] == alone[2]
    assert len(together[1]) == len(alone[1]) and all(torch.equal(a, b) for a, b in zip(together[1], alone[1]))


def test_a_step_that_raised_is_encoded_by_the_next(tiny_llama):
    """A forward that fails midway leaves its earlier layers' tokens pending; the next append to
    such a layer encodes them first, so nothing stays in full precision by accident."""
    cache = CompressedCache(tiny_llama.config, "nvfp4")
    ids = torch.randint(0, 256, (1, 41), generator=torch.Generator().manual_seed(6))
    forward(tiny_llama, ids[:, :40], cache)
    k = torch.randn(1, cache.layers[0].keys.shape[1], 1, cache.layers[0].keys.shape[-1])
    layer = cache.layers[0]
    encoded = lambda: sum(seg.length for seg in layer.segments)  # noqa: E731
    before = encoded()
    cache.update(k, k, 0)  # layer 0 of a step whose later layers never ran
    assert layer.deferred and encoded() == before and layer.keys.shape[-2] == 1
    cache.update(k, k, 0)  # the next step: the first token goes into the codes, the second waits
    assert layer.deferred and encoded() == before + 1 and layer.keys.shape[-2] == 1
    cache.nbytes()  # what the cache holds is counted settled
    assert not layer.deferred and encoded() == before + 2 and layer.keys.shape[-2] == 0


@pytest.mark.parametrize("layer_class", [CompressedLayer, CompressedSlidingLayer])
def test_reset_forgets_a_pending_replay_and_a_pending_flush(layer_class):
    """`reset` starts from `__init__`'s state: a layer reset midway through a replay once treated the
    next prompt's first tokens as already held and dropped them (10 of 40 kept, positions saying 40)."""
    make = (lambda: layer_class(parse_method("nvfp4").full)) if layer_class is CompressedLayer \
        else (lambda: layer_class(parse_method("nvfp4").full, sliding_window=64))
    k, v = kv(40, seed=3)
    layer = make()
    layer.update(k[..., :30, :], v[..., :30, :])
    layer.start_replay(20)
    layer.reset()
    assert layer.phase == make().phase and layer.cumulative_length == 0
    layer.update(k, v)
    fresh = make()
    fresh.update(k, v)
    assert layer.stored_tokens() == fresh.stored_tokens() == 40 and layer.get_seq_length() == 40
    assert all(torch.equal(a, b) for a, b in zip(layer.dense(), fresh.dense()))
    # a decode step whose encoding was left to `flush_many`, then a reset: nothing of it survives
    layer.append(k[..., :1, :], v[..., :1, :], offer=False, defer=True)
    assert layer.deferred
    layer.reset()
    assert not layer.deferred and layer.phase == make().phase
    layer.update(k[..., :5, :], v[..., :5, :])
    assert layer.stored_tokens() == 5
