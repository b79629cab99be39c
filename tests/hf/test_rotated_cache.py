"""A cache with `rot=hadamard` holds the same bytes, decodes like the plain cache, and reads the
same through the fused kernel as through the reference path (with and without key smoothing and
outlier channels) and the store's records."""

import pytest
import torch
from transformers import DynamicCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.held import cut, install
from kvstrata.hf.layers import CompressedLayer
from kvstrata.hf.topk_attention import reading
from kvstrata.methods import parse_method
from kvstrata.place.block_format import pack, unpack


def test_rotated_bf16_tracks_dense_and_keeps_the_bytes(model, decode_logits):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    ref = decode_logits(model, DynamicCache(config=model.config), ids)
    plain = CompressedCache(model.config, "nvfp4")
    rotated = CompressedCache(model.config, "bf16:rot=hadamard")
    got = decode_logits(model, rotated, ids)
    assert (got[:, 40:] - ref[:, 40:]).abs().mean() < 0.01
    decode_logits(model, plain, ids)
    nvfp4_rot = CompressedCache(model.config, "nvfp4:rot=hadamard")
    decode_logits(model, nvfp4_rot, ids)
    assert nvfp4_rot.nbytes()["total"] == plain.nbytes()["total"]


@pytest.mark.parametrize("codec", ["bf16", "fp8", "mxfp4", "nvfp4", "int4:r=8", "int2:r=8",
                                   "int4:r=0,keys=token,group=64"])
def test_every_codec_rotates_without_storing_anything_per_token(model, decode_logits, codec):
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(4))
    held = []
    for spec in (codec, f"{codec}{',' if ':' in codec else ':'}rot=hadamard"):
        cache = CompressedCache(model.config, spec)
        decode_logits(model, cache, ids)
        held.append(cache.nbytes()["total"])
    assert held[0] == held[1] > 0


@pytest.mark.parametrize("spec", ["nvfp4:rot=hadamard", "int4:r=8,rot=hadamard", "fp8:rot=hadamard+topk:k=16",
                                  # key smoothing goes through the same query / output transforms
                                  "nvfp4:smooth=0.5", "int4:r=8,smooth=0.5,rot=hadamard", "fp8:smooth=1",
                                  # outlier channels: a score bias beside the codes
                                  "nvfp4:outliers=2",
                                  "int4:r=8,keys=token,outliers=3,smooth=0.5,rot=hadamard",
                                  "fp8:outliers=4+tova:keep=0.75", "nvfp4:outliers=3,ofmt=fp8,rot=hadamard",
                                  # values in their own codec (KIVI keys per channel beside NVFP4 values)
                                  "nvfp4:v=int2", "int2:r=8,v=nvfp4,rot=hadamard"])
def test_fused_reads_equal_the_reference_path(model, decode_logits, spec):
    ids = torch.randint(0, 256, (1, 56), generator=torch.Generator().manual_seed(3))

    outs = []
    for fused in (True, False):
        cache = CompressedCache(model.config, spec, fused=fused)
        with reading(model, cache, parse_method(spec)):
            outs.append(decode_logits(model, cache, ids))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=0)


def test_records_round_trip_through_the_rotation():
    """A record holds the rotated codes as held, with the rotation: installed, they read as the
    layer that wrote them did (and so as the original keys, to 4-bit precision)."""
    recipe = parse_method("nvfp4:rot=hadamard").full
    k, v = torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64)
    layer = CompressedLayer(recipe)
    layer.update(k, v)
    record = pack({0: cut(layer, 0, 32, encode_tail=True)}, 32)
    back = CompressedLayer(recipe)
    held = unpack({0: recipe}, *record, kv_heads=2, head_dim=64, dtype=torch.float32, start=0, tokens=32)
    install(back, [held[0]], 32, k[..., :0, :])
    for got, want in zip(back.dense(), layer.dense()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = CompressedLayer(parse_method("nvfp4").full)
    plain.update(k, v)
    err, ref_err = (back.dense()[0] - k).abs().mean(), (plain.dense()[0] - k).abs().mean()
    assert err < 1.5 * ref_err  # decoded back to the original (unrotated) keys
