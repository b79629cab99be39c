"""Sink tokens (`sink=N`: the oldest tokens of full-attention layers stay in bf16) and key centering
(`center=1`: codes hold keys less their per-channel prefill mean). Fused reads equal the reference
path: tests/read/test_decode.py; bad specs: tests/test_methods.py."""

import torch

from kvstrata.hf.layers import CompressedLayer, CompressedSlidingLayer
from kvstrata.methods import parse_method


def kv(n, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)


def test_sink_tokens_stay_in_bf16_and_are_counted():
    k, v = kv(40)
    k[..., 0, :] *= 30  # a sink-like first token, far from the rest
    plain, sunk = (CompressedLayer(parse_method(s).full) for s in ("nvfp4", "nvfp4:sink=3"))
    for layer in (plain, sunk):
        layer.update(k, v)
    dk, dv = sunk.dense()
    assert dk.shape == k.shape and sunk.stored_tokens() == 40
    torch.testing.assert_close(dk[..., :3, :], k[..., :3, :].bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(dv[..., :3, :], v[..., :3, :].bfloat16().float(), rtol=0, atol=0)
    assert (dk[..., 3:, :] - k[..., 3:, :]).abs().max() > 0  # the rest is encoded
    # bf16 K and V of 3 tokens per head in place of their NVFP4 codes and block scales (18 B each)
    assert sunk.nbytes() - plain.nbytes() == 3 * 2 * (2 * 2 * 32 - 2 * 18)
    pk, _ = plain.dense()
    assert (dk[..., 0, :] - k[..., 0, :]).abs().max() < (pk[..., 0, :] - k[..., 0, :]).abs().max()


def test_a_bf16_sink_is_a_copy_not_a_view_of_the_prefill():
    k, v = kv(40)
    layer = CompressedLayer(parse_method("nvfp4:sink=3").full)
    layer.load_prefill(k.bfloat16(), v.bfloat16(), 40)
    assert layer.sink[0].untyped_storage().nbytes() == 3 * 2 * 32 * 2  # not the whole prefill's storage
    fp32 = CompressedLayer(parse_method("nvfp4:sink=3").full)
    fp32.load_prefill(k, v, 40)
    assert layer.nbytes() == fp32.nbytes()


def test_a_prompt_shorter_than_the_residual_fills_the_sink_then_whole_groups():
    k, v = kv(40)
    layer = CompressedLayer(parse_method("int2:group=8,r=16,sink=4").full)
    layer.update(k[..., :2, :], v[..., :2, :])  # shorter than the sink: all of it goes there
    assert layer.sink[0].shape[-2] == 2 and layer.keys.shape[-2] == 0
    for i in range(2, 40):
        layer.update(k[..., i : i + 1, :], v[..., i : i + 1, :])
    assert layer.sink[0].shape[-2] == 4  # topped up before anything was encoded
    # nothing ragged after the prefill: whole groups of 8 once 16 tokens wait beyond the sink
    assert all(s.length % 8 == 0 for s in layer.segments) and layer.stored_tokens() == 40
    torch.testing.assert_close(layer.dense()[0][..., :4, :], k[..., :4, :].bfloat16().float(), rtol=0, atol=0)


def test_the_sink_is_taken_once_and_decode_tokens_are_encoded_after_it():
    k, v = kv(30)
    layer = CompressedLayer(parse_method("int4:keys=channel,group=8,r=0,sink=2").full)
    layer.update(k[..., :13, :], v[..., :13, :])  # 2 sink tokens, a ragged prefill of 11
    assert layer.sink[0].shape[-2] == 2 and [s.length for s in layer.segments] == [11]
    for i in range(13, 30):
        layer.update(k[..., i : i + 1, :], v[..., i : i + 1, :])
    assert layer.sink[0].shape[-2] == 2 and layer.stored_tokens() == 30
    assert [s.length for s in layer.segments] == [11, 16] and layer.keys.shape[-2] == 1
    torch.testing.assert_close(layer.dense()[0], k, atol=1.0, rtol=0)  # every token in its place


def test_sliding_layers_hold_no_sink():
    k, v = kv(40)
    layer = CompressedSlidingLayer(parse_method("nvfp4:sink=4").full, 16)
    layer.update(k, v)
    assert layer.sink is None and layer.stored_tokens() == 15


def test_centering_takes_a_channel_offset_out_of_the_codes():
    k, v = kv(64)
    k = k + torch.linspace(-20, 20, 32)  # per-channel offsets dwarf the per-token spread
    errors, held = {}, {}
    for spec in ("nvfp4", "nvfp4:center=1"):
        layer = CompressedLayer(parse_method(spec).full)
        layer.update(k, v)
        errors[spec] = (layer.dense()[0] - k).abs().mean().item()
        held[spec] = layer.nbytes()
    assert errors["nvfp4:center=1"] < 0.5 * errors["nvfp4"]
    assert held["nvfp4:center=1"] - held["nvfp4"] == 2 * 32 * 4  # fp32 means per KV head and channel
    layer.reset()
    assert layer.fitted is None
