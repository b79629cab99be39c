"""K apart from V (`v=<codec>`): the values take their own codec, and the bytes are the keys' plus the
values' (fused reads = the reference path: tests/hf/test_rotated_cache.py)."""

import torch

from kvstrata.hf import CompressedCache
from kvstrata.hf.layers import CompressedLayer
from kvstrata.methods import parse_method


def _rows(spec: str) -> tuple[float, float]:
    layer = CompressedLayer(parse_method(spec).full)
    layer.update(torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64))
    return layer.row_bytes(256)


def test_each_half_costs_what_its_own_codec_costs():
    k_nvfp4, _ = _rows("nvfp4")
    _, v_int2 = _rows("int2:keys=token")
    assert _rows("nvfp4:v=int2") == (k_nvfp4, v_int2)


def test_values_decode_with_their_codec(model, decode_logits):
    ids = torch.randint(0, 256, (1, 56), generator=torch.Generator().manual_seed(4))
    out, held = {}, {}
    for spec in ("bf16", "bf16:v=nvfp4", "nvfp4"):
        cache = CompressedCache(model.config, spec)
        out[spec] = decode_logits(model, cache, ids)
        held[spec] = cache.nbytes()["total"]
        layer = next(lay for lay in cache.layers if lay.segments)
        assert layer.segments[0].values.codec.name == parse_method(spec).full.value_codec.name
    assert (out["bf16:v=nvfp4"] - out["bf16"]).abs().max() > 0
    assert held["nvfp4"] < held["bf16:v=nvfp4"] < held["bf16"]


def test_only_the_half_named_is_quantized():
    k, v = torch.randn(1, 2, 48, 64), torch.randn(1, 2, 48, 64)
    for spec, exact in (("bf16:v=nvfp4", 0), ("nvfp4:v=bf16", 1)):
        layer = CompressedLayer(parse_method(spec).full)
        layer.update(k, v)
        got = layer.dense()
        torch.testing.assert_close(got[exact], (k, v)[exact], rtol=2**-8, atol=1e-6)
        assert (got[1 - exact] - (k, v)[1 - exact]).abs().max() > 0.01
