"""Key smoothing (`smooth=A`): per-channel key divisors set from the prefill, the query multiplied by
them; q.k unchanged, fused reads equal the reference path, outlier channels stop costing precision."""

import pytest
import torch
from transformers import DynamicCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.layers import CompressedLayer, smoothing_scale
from kvstrata.hf.reading import reading
from kvstrata.hf.run import forward
from kvstrata.methods import parse_method


def run(model, cache, ids, prefill=40):
    """Prefill 40 tokens, then decode the rest one at a time: the logits of every position."""
    out = [forward(model, ids[:, :prefill], cache, logits_to_keep=prefill)]
    out += [forward(model, ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.fixture(params=["llama", "gemma3"])
def model(request, tiny_llama, tiny_gemma):
    return tiny_llama if request.param == "llama" else tiny_gemma


def test_scale_keeps_the_keys_overall_size_and_q_dot_k():
    k = torch.randn(1, 2, 50, 16) * torch.linspace(0.1, 30, 16)
    s = smoothing_scale(k, 0.5)
    assert s.shape == (1, 2, 1, 16)
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(1, 2, 1))  # geometric mean 1 per head
    assert smoothing_scale(k, 0.0).eq(1).all()
    q = torch.randn(1, 2, 1, 16)
    torch.testing.assert_close((q * s) @ (k / s).transpose(-1, -2), q @ k.transpose(-1, -2))


def test_smoothed_bf16_tracks_dense_and_counts_its_divisors(model):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = run(model, DynamicCache(config=model.config), ids)
    cache = CompressedCache(model.config, "bf16:smooth=0.5")
    got = run(model, cache, ids)
    assert (got[:, 40:] - ref[:, 40:]).abs().mean() < 0.01
    plain = CompressedCache(model.config, "bf16")
    run(model, plain, ids)
    extra = sum(layer.key_scale.numel() * 4 for layer in cache.layers)
    assert cache.nbytes()["total"] == plain.nbytes()["total"] + extra


@pytest.mark.parametrize("spec", ["nvfp4:smooth=0.5", "int4:r=8,smooth=0.5,rot=hadamard", "fp8:smooth=1"])
def test_fused_reads_equal_the_reference_path(model, spec):
    ids = torch.randint(0, 256, (1, 56), generator=torch.Generator().manual_seed(3))
    outs = []
    for fused in (True, False):
        cache = CompressedCache(model.config, spec, fused=fused)
        with reading(model, cache, parse_method(spec)):
            outs.append(run(model, cache, ids))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=0)


def test_an_outlier_channel_no_longer_sets_every_tokens_scale():
    torch.manual_seed(0)
    k = torch.randn(1, 1, 64, 32)
    k[..., 3] *= 40  # one outlier channel, as Llama-style keys have
    q = torch.randn(1, 1, 1, 32)
    errors = {}
    for spec in ("nvfp4", "nvfp4:smooth=0.5"):
        layer = CompressedLayer(parse_method(spec).full)
        layer.update(k, k)
        dk, _ = layer.dense()
        errors[spec] = ((q @ dk.transpose(-1, -2)) - (q @ k.transpose(-1, -2))).abs().mean().item()
    assert errors["nvfp4:smooth=0.5"] < 0.5 * errors["nvfp4"]


@pytest.mark.parametrize("spec, message", [
    ("nvfp4:smooth=2", r"smooth must be a number in \[0, 1\]"),
    ("nvfp4:smooth=x", "smooth must be"),
    ("nvfp4:smooth=0.5+topk:k=8", "does not combine"),
])
def test_bad_smoothing_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)
