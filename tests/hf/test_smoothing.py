"""Key smoothing (`smooth=A`): per-channel key divisors set from the prefill, the query multiplied by
them; q.k unchanged, outlier channels stop costing precision (fused reads = the reference path:
tests/hf/test_rotated_cache.py; bytes counted: tests/hf/test_outliers.py; bad specs:
tests/test_methods.py)."""

import pytest
import torch

from kvstrata.codecs.smoothing import smoothing_scale
from kvstrata.hf.layers import CompressedLayer
from kvstrata.methods import parse_method


def test_scale_keeps_the_keys_overall_size_and_q_dot_k():
    torch.manual_seed(0)  # fixed inputs: the q.k check sits near float32 rounding
    k = torch.randn(1, 2, 50, 16) * torch.linspace(0.1, 30, 16)
    s = smoothing_scale(k, 0.5)
    assert s.shape == (1, 2, 1, 16)
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(1, 2, 1))  # geometric mean 1 per head
    assert smoothing_scale(k, 0.0).eq(1).all()
    q = torch.randn(1, 2, 1, 16)
    torch.testing.assert_close((q * s) @ (k / s).transpose(-1, -2), q @ k.transpose(-1, -2))


@pytest.mark.parametrize("spec", ["nvfp4:smooth=0.5", "nvfp4:outliers=1", "nvfp4:outliers=1,ofmt=fp8",
                                  "int4:keys=token,r=0,outliers=1"])
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
