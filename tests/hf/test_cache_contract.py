"""Every registered store method runs the same contract on tiny Llama and Gemma-3 models."""

import pytest
import torch
from transformers import DynamicCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.run import bf16_bytes_per_token, forward, generate
from kvstrata.methods import METHODS
from kvstrata.models.tiny import byte_tokenizer

# mean |logit error| allowed after decoding over an encoded cache (tiny random models)
TOL = {"bf16": 0.01, "fp8": 0.05, "int4": 0.1, "nvfp4": 0.2, "mxfp4": 0.2, "int2": 0.5}
METHOD_SPECS = [f"{n}:r=0" if n.startswith("int") else n for n, e in METHODS.items() if e.stratum == "store"]


def run(model, cache, ids, prefill):
    logits = [forward(model, ids[:, :prefill], cache, logits_to_keep=prefill)]
    for i in range(prefill, ids.shape[1]):
        logits.append(forward(model, ids[:, i : i + 1], cache))
    return torch.cat(logits, dim=1)


@pytest.fixture(params=["llama", "gemma3"])
def model(request, tiny_llama, tiny_gemma):
    return tiny_llama if request.param == "llama" else tiny_gemma


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_decoding_over_encoded_cache_tracks_dense(model, spec):
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(1))
    ref = run(model, DynamicCache(config=model.config), ids, 40)
    cache = CompressedCache(model.config, spec)
    got = run(model, cache, ids, 40)
    # the prefill itself attends in full precision: identical
    torch.testing.assert_close(got[:, :40], ref[:, :40], rtol=0, atol=1e-4)
    assert (got[:, 40:] - ref[:, 40:]).abs().mean() < TOL[spec.split(":")[0]]
    assert cache.get_seq_length() == 72


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_nbytes_is_what_is_held(model, spec):
    cache = CompressedCache(model.config, spec)
    forward(model, torch.randint(0, 256, (1, 50)), cache)
    report = cache.nbytes()
    assert report["total"] == sum(report["layers"]) > 0
    for layer, n in zip(cache.layers, report["layers"]):
        held = {}
        for seg in layer.segments:
            for t in seg.parts():
                held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        for t in (layer.keys, layer.values):
            held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        assert n == sum(held.values())


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_works_inside_generate(model, spec):
    tok = byte_tokenizer()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    g = generate(model, tok, ids, spec, max_new_tokens=6)
    assert len(g.new_tokens) == 6
    assert g.kv_bytes_per_token > 0


def test_bf16_bytes_equal_hand_count(model):
    cache = CompressedCache(model.config, "bf16")
    n = 40
    forward(model, torch.randint(0, 256, (1, n)), cache)
    text = model.config.get_text_config()
    per_token_layer = 2 * text.num_key_value_heads * text.head_dim * 2
    windows = [getattr(layer, "sliding_window", None) for layer in cache.layers]
    expected = [per_token_layer * (min(n, w - 1) if w else n) for w in windows]
    assert cache.nbytes()["layers"] == expected
    assert cache.bytes_per_token() == pytest.approx(bf16_bytes_per_token(model.config, n))


def test_generate_equals_manual_greedy_loop(tiny_llama):
    tok = byte_tokenizer()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    g = generate(tiny_llama, tok, ids, "nvfp4:r=4", max_new_tokens=5)
    cache = CompressedCache(tiny_llama.config, "nvfp4:r=4")
    logits = forward(tiny_llama, ids, cache)
    manual = []
    for _ in range(5):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        manual.append(nxt.item())
        logits = forward(tiny_llama, nxt, cache)
    assert g.new_tokens == manual
