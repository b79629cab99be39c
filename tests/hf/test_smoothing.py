"""Key smoothing (`smooth=A`): per-channel key divisors set from the prefill, the query multiplied by
them; q.k unchanged, outlier channels stop costing precision (fused reads = the reference path:
tests/hf/test_rotated_cache.py)."""

import pytest
import torch
from transformers import DynamicCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.layers import CompressedLayer, smoothing_scale
from kvstrata.methods import parse_method


def test_scale_keeps_the_keys_overall_size_and_q_dot_k():
    k = torch.randn(1, 2, 50, 16) * torch.linspace(0.1, 30, 16)
    s = smoothing_scale(k, 0.5)
    assert s.shape == (1, 2, 1, 16)
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(1, 2, 1))  # geometric mean 1 per head
    assert smoothing_scale(k, 0.0).eq(1).all()
    q = torch.randn(1, 2, 1, 16)
    torch.testing.assert_close((q * s) @ (k / s).transpose(-1, -2), q @ k.transpose(-1, -2))


def test_smoothed_bf16_tracks_dense_and_counts_its_divisors(model, decode_logits):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = decode_logits(model, DynamicCache(config=model.config), ids)
    cache = CompressedCache(model.config, "bf16:smooth=0.5")
    got = decode_logits(model, cache, ids)
    assert (got[:, 40:] - ref[:, 40:]).abs().mean() < 0.01
    plain = CompressedCache(model.config, "bf16")
    decode_logits(model, plain, ids)
    extra = sum(layer.key_scale.numel() * 4 for layer in cache.layers)
    assert cache.nbytes()["total"] == plain.nbytes()["total"] + extra


@pytest.mark.parametrize("spec", ["nvfp4:smooth=0.5", "nvfp4:outliers=1", "int4:keys=token,r=0,outliers=1"])
def test_an_outlier_channel_no_longer_sets_every_tokens_scale(spec):
    torch.manual_seed(0)
    k = torch.randn(1, 1, 64, 32)
    k[..., 3] *= 40  # one outlier channel, as Llama-style keys have
    q = torch.randn(1, 1, 1, 32)
    errors = {}
    plain = spec.split(":")[0] + (":keys=token,r=0" if spec.startswith("int4") else "")
    for s in (plain, spec):
        layer = CompressedLayer(parse_method(s).full)
        layer.update(k, k)
        dk, _ = layer.dense()
        errors[s] = ((q @ dk.transpose(-1, -2)) - (q @ k.transpose(-1, -2))).abs().mean().item()
    assert errors[spec] < 0.5 * errors[plain]


@pytest.mark.parametrize("spec, message", [
    ("nvfp4:smooth=2", r"smooth must be a number in \[0, 1\]"),
    ("nvfp4:smooth=x", "smooth must be"),
    ("nvfp4:smooth=0.5+topk:k=8", "does not combine"),
])
def test_bad_smoothing_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)
