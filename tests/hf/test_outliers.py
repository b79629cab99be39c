"""Outlier key channels kept apart (`outliers=c`): chosen from the prefill, stored in bf16 (or FP8,
`ofmt=fp8`) beside the codes, counted in the bytes (key smoothing's divisors too), put back exactly
(fused reads = the reference path, and the gain on an outlier channel: tests/hf/test_rotated_cache.py,
tests/hf/test_smoothing.py; bad specs: tests/test_methods.py)."""

import pytest
import torch
from transformers import DynamicCache

from kvstrata.codecs.outliers import (
    Outliers,
    merge_outliers,
    outlier_channels,
    score_bias,
    split_outliers,
    zero_channels,
)
from kvstrata.codecs.smoothing import Smooth
from kvstrata.hf import CompressedCache
from kvstrata.hf.layers import CompressedLayer
from kvstrata.methods import parse_method


def test_the_largest_channels_are_split_off_and_put_back():
    k = torch.randn(2, 3, 20, 16)
    k[0, 1, :, 9] *= 50
    k[1, 2, 4, 2] = 300.0  # one token is enough to make a channel an outlier
    idx = outlier_channels(k, 2)
    assert idx.shape == (2, 3, 2) and (idx.diff(dim=-1) > 0).all()
    assert 9 in idx[0, 1] and 2 in idx[1, 2]
    rest, kept = split_outliers(k, idx)
    assert kept.dtype == torch.bfloat16 and kept.shape == (2, 3, 20, 2)
    assert rest.gather(-1, idx[..., None, :].expand(2, 3, 20, 2)).eq(0).all()
    back = merge_outliers(rest, kept, idx)
    torch.testing.assert_close(back, k, rtol=2**-8, atol=0)  # the kept channels at bf16 precision


def test_fp8_kept_channels_round_to_e4m3_and_saturate():
    k = torch.randn(1, 2, 16, 8) * 20
    k[0, 0, 3, 5] = 1000.0  # beyond E4M3's range
    idx = outlier_channels(k, 2)
    rest, kept = split_outliers(k, idx, "fp8")
    assert kept.dtype == torch.uint8 and kept.shape == (1, 2, 16, 2)  # one byte per channel
    back = merge_outliers(rest, kept, idx)
    assert back[0, 0, 3, 5] == 448.0
    k[0, 0, 3, 5] = 448.0
    torch.testing.assert_close(back, k, rtol=2**-4, atol=2**-9)  # E4M3: 3 mantissa bits


def test_the_bias_and_the_zeroed_query_add_up_to_q_dot_k():
    g = torch.Generator().manual_seed(0)  # the kept channels are bf16: error grows with |q| |k|
    k, q = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 6, 1, 16, generator=g)  # GQA 3
    idx = outlier_channels(k, 3)
    rest, kept = split_outliers(k, idx)
    scores = zero_channels(q, idx) @ rest.repeat_interleave(3, 1).transpose(-1, -2)
    got = scores[:, :, 0] + score_bias(q, idx, kept.float())
    want = (q @ k.repeat_interleave(3, 1).transpose(-1, -2))[:, :, 0]
    # exact but for the kept channels' bf16 rounding: |q_c k_c| 2^-8 each, at most
    bound = score_bias(q.abs(), idx, kept.float().abs()) * 2**-8 + 1e-5
    assert ((got - want).abs() <= bound).all()


def _divisors(layer) -> int:
    return layer.fitted.state_of(Smooth)["scale"].numel() * 4  # fp32 per channel, KV head and layer


def _kept_channels(layer) -> int:
    idx = layer.fitted.state_of(Outliers)["idx"]
    tokens, heads = layer.stored_tokens() - layer.keys.shape[-2], idx.shape[1]
    return tokens * heads * 4 * 2 + idx.numel() * 8  # 4 bf16 channels, int64 indices


@pytest.mark.parametrize("spec, extra", [("bf16:smooth=0.5", _divisors), ("bf16:outliers=4", _kept_channels)])
def test_exact_key_transforms_track_dense_and_count_what_they_hold(model, decode_logits, spec, extra):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = decode_logits(model, DynamicCache(config=model.config), ids)
    cache = CompressedCache(model.config, spec)
    got = decode_logits(model, cache, ids)
    assert (got[:, 40:] - ref[:, 40:]).abs().mean() < 0.01
    plain = CompressedCache(model.config, "bf16")
    decode_logits(model, plain, ids)
    for layer in cache.layers + plain.layers:
        layer.shrink()  # spare rows reserved for appends hold kept channels too: count tokens held only
    assert cache.nbytes()["total"] == plain.nbytes()["total"] + sum(extra(layer) for layer in cache.layers)


def test_a_key_row_gains_the_kept_channels():
    rows = []
    for spec in ("nvfp4", "nvfp4:outliers=4", "nvfp4:outliers=4,ofmt=fp8"):
        layer = CompressedLayer(parse_method(spec).full)
        layer.update(torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64))
        rows.append(layer.row_bytes(256))
    assert rows[1] == (rows[0][0] + 4 * 2, rows[0][1])  # a key row gains 4 bf16 channels
    assert rows[2] == (rows[0][0] + 4, rows[0][1])  # ... or 4 FP8 ones


def test_outlier_channels_are_chosen_once_from_the_prefill():
    layer = CompressedLayer(parse_method("nvfp4:outliers=1").full)
    k = torch.randn(1, 1, 32, 16)
    k[..., 5] *= 30
    layer.update(k, k)
    assert layer.fitted.state_of(Outliers)["idx"].tolist() == [[[5]]]
    later = torch.randn(1, 1, 1, 16)
    later[..., 7] = 500.0  # a decode token does not move them
    layer.update(later, later)
    assert layer.fitted.state_of(Outliers)["idx"].tolist() == [[[5]]]
    dk, _ = layer.dense()
    assert dk[0, 0, -1, 7] == 500.0  # ... and is still held (the full-precision tail)


def test_more_outliers_than_the_head_has_is_refused(tiny_llama):
    head_dim = tiny_llama.config.head_dim
    with pytest.raises(ValueError, match=f"keeps {head_dim} outlier channels; the model's head_dim is"):
        CompressedCache(tiny_llama.config, f"nvfp4:outliers={head_dim}")
