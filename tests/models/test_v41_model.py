"""The V4.1 reference model: CSA2 modes, hierarchical selection, causality, FP4 storage, half-depth
prefill equivalence and allocated bytes against the accounting."""

import pytest
import torch

from kvstrata.codecs import quantize
from kvstrata.models.v41 import V41Cache, V41ForCausalLM, csa2, preset
from kvstrata.models.v41_layout import totals


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return V41ForCausalLM(preset("tiny-v41", n_win=16)).eval()


def record(model):
    """Capture each layer's selection context (idx / candidates) during a forward."""
    seen = {}

    def hook(mod, args, kwargs, out):
        seen[mod.layer] = {k: v for k, v in args[4][mod.layer].items()}

    hs = [layer.attn.register_forward_hook(hook, with_kwargs=True) for layer in model.layers]
    return seen, hs


def test_layer_pattern_scales_the_published_one():
    cfg = preset("tiny-v41")
    assert cfg.layer_modes == ["swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert cfg.compress == [0, 0, 2, 2, 1, 1, 1, 1]
    assert [cfg.source(i) for i in (3, 5, 6, 7)] == [2, 4, 4, 4]


def test_compress_m2_is_a_gated_softmax_over_each_pair():
    kv, gate = torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    out = csa2.compress(kv, gate, 2)
    w = gate[0, :2].softmax(0)
    assert torch.allclose(out[0, 0], (w * kv[0, :2]).sum(0), atol=1e-6)
    assert torch.equal(csa2.compress(kv, None, 1), kv)
    with pytest.raises(ValueError, match="multiple of m=2"):
        csa2.compress(kv[:, :3], gate[:, :3], 2)


def test_visibility_rule():
    t = torch.arange(8)
    assert csa2.visible(t, 2).tolist() == [0, 1, 1, 2, 2, 3, 3, 4]  # j < floor((t+1)/2)
    assert csa2.visible(t, 1).tolist() == list(range(1, 9))


def test_modes_causality_and_hierarchical_newest_block(tiny):
    cfg = tiny.config
    ids = torch.randint(0, cfg.vocab_size, (1, 60))
    seen, hs = record(tiny)
    with torch.no_grad():
        tiny(ids, use_cache=False)
    for h in hs:
        h.remove()
    pos = torch.arange(60)
    for layer in (2, 3, 4, 5, 6, 7):
        ctx = seen[layer]
        vis = csa2.visible(pos, ctx["m"])
        idx = ctx["idx"][0]
        assert (idx < vis[:, None]).all(), f"layer {layer} selected an entry its query may not read"
        assert ((idx >= 0).sum(-1) == torch.clamp(vis, max=cfg.index_topk)
                ).all()  # empty slots only when too few
    assert torch.equal(seen[3]["idx"], seen[2]["idx"]) and torch.equal(
        seen[5]["idx"], seen[4]["idx"])  # Reuse
    assert seen[3]["lat"] is seen[2]["lat"]
    cand = seen[4]["cand"][0]
    newest = torch.div(csa2.visible(pos, 1) - 1, cfg.hier_block, rounding_mode="floor")
    for t in range(60):  # the newest visible block is always among the candidates
        blk = set(range(int(newest[t]) * cfg.hier_block, min(int(newest[t] + 1) * cfg.hier_block, t + 1)))
        assert blk <= set(cand[t].tolist())
    # Reindex re-scores Layer 4's candidates with its own queries: a subset, not a copy
    re = seen[6]["idx"][0]
    assert all(set(re[t][re[t] >= 0].tolist()) <= set(cand[t].tolist()) for t in range(60))
    assert not torch.equal(re, seen[4]["idx"][0])


def test_full_topk_is_the_top_of_its_own_scores():
    scores = csa2.causal_scores(torch.randn(1, 5, 6), torch.tensor([1, 2, 3, 4, 6]))
    idx = csa2.topk(scores, 3)
    assert idx[0, 0].tolist()[1:] == [-1, -1] and idx[0, 0, 0] == 0
    assert set(idx[0, 4].tolist()) == set(scores[0, 4].topk(3).indices.tolist())


def test_model_is_causal(tiny):
    a = torch.randint(0, 512, (1, 40))
    b = a.clone()
    b[0, 30:] = torch.randint(0, 512, (10,))
    with torch.no_grad():
        la, lb = tiny(a, use_cache=False).logits, tiny(b, use_cache=False).logits
    assert torch.allclose(la[0, :30], lb[0, :30], atol=1e-5)


def test_global_kv_is_stored_fp4_and_swa_fp8(tiny):
    cache = V41Cache(tiny.config)
    with torch.no_grad():
        tiny(torch.randint(0, 512, (1, 24)), past_key_values=cache)
    full = cache.layers[4]
    assert full.latents.rows.spec.startswith("nvfp4") and full.swa.rows.spec == "fp8"
    assert full.index_keys.rows.spec == "mxfp4"
    lat = full.latents.read(torch.float32)
    assert torch.equal(quantize(lat, "nvfp4:tensor_scale=0").dequantize(), lat)  # on the FP4 grid
    assert len(cache.layers[3].latents) == 0 and len(cache.layers[6].latents) == 0  # Reuse / Reindex own none


@pytest.fixture(scope="module")
def tiny_swa_values():
    """Pure-SWA layers with V projected apart from K."""
    torch.manual_seed(2)
    return V41ForCausalLM(preset("tiny-v41", n_win=16, swa_values=True)).eval()


@pytest.mark.parametrize("tokens", [32, 64])
@pytest.mark.parametrize("variant", ["tiny", "tiny_swa_values"])
def test_allocated_bytes_equal_the_accounting(variant, tokens, request):
    tiny = request.getfixturevalue(variant)
    cache = V41Cache(tiny.config)
    with torch.no_grad():
        tiny(torch.randint(0, 512, (1, tokens)), past_key_values=cache, half_depth=False)
    held = cache.nbytes()
    plan = totals(tiny.config.layout())
    assert held["pending"] == 0
    assert held["global"] + held["index"] == plan["global_kv_bytes_per_token"] * tokens
    assert held["swa"] == plan["swa_bytes_per_sequence"]


def test_v41_flash_preset_on_meta_device_matches_890():
    cfg = preset("v41-flash")
    with torch.device("meta"):
        model = V41ForCausalLM(cfg)
    assert len(model.layers) == 40 and model.layers[20].attn.mode == "full"
    assert totals(cfg.layout())["global_kv_bytes_per_token"] == 890


@pytest.fixture(scope="module")
def tiny_v4_attention():
    """Sinks and output de-rotation on, sinks non-zero."""
    torch.manual_seed(1)
    model = V41ForCausalLM(preset("tiny-v41", n_win=16, attn_sink=True, derotate=True)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.normal_()
    return model


@pytest.mark.parametrize("variant", ["tiny", "tiny_v4_attention", "tiny_swa_values"])
def test_half_depth_prefill_equals_full_depth_when_prompt_fits_n_win(variant, request):
    tiny = request.getfixturevalue(variant)
    ids = torch.randint(0, 512, (1, 16))  # n_win = 16
    nxt = torch.randint(0, 512, (1, 4))
    out = {}
    for half in (True, False):
        cache = V41Cache(tiny.config)
        with torch.no_grad():
            first = tiny(ids, past_key_values=cache, half_depth=half).logits[:, -1]
            steps = [tiny(nxt[:, i:i + 1], past_key_values=cache).logits[:, -1] for i in range(4)]
        out[half] = torch.stack([first, *steps])
    assert torch.allclose(out[True], out[False], atol=1e-5)


def test_half_depth_runs_the_decoder_on_n_win_tokens_only(tiny):
    cfg = tiny.config
    counts = {}
    hs = [layer.register_forward_hook(lambda mod, args, out, i=i: counts.__setitem__(i, args[0].shape[1]))
          for i, layer in enumerate(tiny.layers)]
    cache = V41Cache(cfg)
    with torch.no_grad():
        logits = tiny(torch.randint(0, 512, (1, 64)), past_key_values=cache).logits
    for h in hs:
        h.remove()
    assert [counts[i] for i in range(cfg.num_hidden_layers)] == [64] * cfg.split + [cfg.n_win] * cfg.split
    assert logits.shape[1] == cfg.n_win
    dec = cache.layers[cfg.split]
    assert len(dec.latents) == 64  # decoder global KV covers the whole prompt (from the layer-L/2 input)
    assert dec.swa_pos0 == 64 - min(cfg.n_win, cfg.sliding_window)  # SWA: bounded replay of the last tokens
    assert cache.get_seq_length() == 64


def test_generate_runs(tiny):
    ids = torch.randint(0, 512, (1, 20))
    out = tiny.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 24)


def test_derotated_output_depends_on_distance_only():
    g = torch.Generator().manual_seed(3)
    q, s = torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 6, 16, generator=g)
    lat = torch.randn(1, 3, 16, generator=g)
    idx = torch.tensor([[[0, 1, 2]] * 6])

    def out(shift: int, derotate: bool):
        pos = torch.arange(6) + shift
        qr, sr = csa2.rope(q, pos, 8, 1e4), csa2.rope(s, pos, 8, 1e4)
        lr = csa2.rope(lat, torch.arange(3) * 2 + shift, 8, 1e4)
        o = csa2.attend(qr, pos, sr, shift, 4, lr, idx)
        return csa2.rope(o, -pos, 8, 1e4) if derotate else o

    torch.testing.assert_close(out(0, True), out(37, True), atol=1e-5, rtol=0)
    assert not torch.allclose(out(0, False), out(37, False), atol=1e-3)


def test_attention_sink_takes_mass_and_adds_nothing():
    g = torch.Generator().manual_seed(4)
    q, s = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    plain = csa2.attend(q, torch.arange(5), s, 0, 8, None, None)
    torch.testing.assert_close(csa2.attend(q, torch.arange(5), s, 0, 8, None,
                               None, torch.full((2,), float("-inf"))), plain)
    sunk = csa2.attend(q, torch.arange(5), s, 0, 8, None, None, torch.tensor([40.0, float("-inf")]))
    assert sunk[:, 0].abs().max() < 1e-6  # head 0 attends to its sink: nothing added
    torch.testing.assert_close(sunk[:, 1], plain[:, 1])
    model = V41ForCausalLM(preset("tiny-v41", attn_sink=True, derotate=True))
    assert all(layer.attn.sinks is not None and not layer.attn.sinks.any() for layer in model.layers)
    assert V41ForCausalLM(preset("tiny-v41")).layers[0].attn.sinks is None


def test_swa_values_layers_hold_v_apart_and_double_their_swa_bytes(tiny_swa_values):
    cfg = tiny_swa_values.config
    plain = totals(preset("tiny-v41", n_win=16).layout())["swa_bytes_per_sequence"]
    split = totals(cfg.layout())["swa_bytes_per_sequence"]
    per_layer = plain / cfg.num_hidden_layers
    assert split == plain + per_layer * cfg.layer_modes.count("swa")
    cache = V41Cache(cfg)
    with torch.no_grad():
        tiny_swa_values(torch.randint(0, 512, (1, 24)), past_key_values=cache)
    assert [layer.swa_v is not None for layer in cache.layers] == [m == "swa" for m in cfg.layer_modes]
    with pytest.raises(ValueError, match="V rows"):
        cache.layers[2].write_swa(torch.zeros(1, 1, cfg.latent_dim), 24, torch.zeros(1, 1, cfg.latent_dim))
