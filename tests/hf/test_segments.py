"""`kvstrata.hf.segments`: encoded runs of tokens, appended in place, hidden and freed from the front."""

import pytest
import torch

from kvstrata.codecs.transform import Fitted
from kvstrata.hf import segments
from kvstrata.hf.segments import append, decode_segment, drop_front, encode_segment, shrink
from kvstrata.methods import parse_method


def kv(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g)


@pytest.mark.parametrize("spec", ["bf16", "fp8", "nvfp4", "int4:r=0", "int2:r=0,keys=token"])
def test_appends_decode_as_one_encode(spec):
    recipe = parse_method(spec).full
    k, v = kv(96)
    seg = encode_segment(recipe, k[..., :32, :], v[..., :32, :], reserve=64)
    assert append(recipe, seg, k[..., 32:64, :], v[..., 32:64, :])
    assert append(recipe, seg, k[..., 64:, :], v[..., 64:, :])
    assert not append(recipe, seg, k[..., :32, :], v[..., :32, :])  # the reserve is spent
    dk, dv = decode_segment(recipe, seg, torch.float32)
    assert dk.shape == k.shape and seg.length == 96
    if recipe.codec.name != "nvfp4":  # NVFP4 shares a headroom tensor scale across appends
        whole = encode_segment(recipe, k, v)
        ek, ev = decode_segment(recipe, whole, torch.float32)
        torch.testing.assert_close(dk, ek, rtol=0, atol=0)
        torch.testing.assert_close(dv, ev, rtol=0, atol=0)
    else:
        assert (dk - k).abs().max() < 0.5 * k.abs().max()


def test_spare_rows_are_counted_until_shrunk():
    recipe = parse_method("fp8").full
    k, v = kv(16)
    seg = encode_segment(recipe, k, v, reserve=48)
    held = sum(t.numel() * t.element_size() for t in seg.parts())
    shrink(seg)
    after = sum(t.numel() * t.element_size() for t in seg.parts())
    assert after * 4 == held and not append(recipe, seg, k, v)


def test_drop_front_hides_then_frees_whole_key_groups():
    recipe = parse_method("int4:group=32,r=0").full  # keys per channel, 32 tokens per group
    k, v = kv(96)
    seg = encode_segment(recipe, k, v)
    hidden = drop_front(recipe, seg, 40, compact=64)  # below the compaction threshold: hidden only
    assert (hidden.length, hidden.skip, hidden.visible) == (96, 40, 56)
    freed = drop_front(recipe, seg, 40)  # one whole key group (32 tokens) freed, 8 stay hidden
    assert (freed.length, freed.skip) == (64, 8)
    a = decode_segment(recipe, hidden, torch.float32)
    b = decode_segment(recipe, freed, torch.float32)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert drop_front(recipe, seg, 96) is None


@pytest.mark.parametrize("spec", ["bf16", "fp8", "fp8:block=8", "nvfp4", "nvfp4:fit=lsq", "mxfp4", "int4:r=0",
                                  "int2:group=16,r=0", "int3:keys=token,group=16,r=0",
                                  "int4:r=0,keys=token,v=nvfp4", "nvfp4:center=1,outliers=2,rot=hadamard",
                                  "int4:keys=channel,group=16,r=0,v=nvfp4,smooth=0.5,rot=hadamard"])
@pytest.mark.parametrize("tokens, reserve", [(200, 0), (203, 0), (200, 64)])
def test_a_long_run_encodes_in_chunks_into_the_codes_of_one_encode(spec, tokens, reserve, monkeypatch):
    """A run longer than ENCODE_CHUNK is encoded a chunk at a time (bounded float32 intermediates);
    every part equals the whole run's encoding byte for byte (a ragged last key group included)."""
    recipe = parse_method(spec).full
    k, v = kv(tokens, seed=3)
    k = k * 4
    fitted = Fitted.fit(recipe.transforms, k)
    whole = encode_segment(recipe, k, v, fitted, reserve)
    monkeypatch.setattr(segments, "ENCODE_CHUNK", 48)
    chunked = encode_segment(recipe, k, v, fitted, reserve)
    for a, b in ((whole.keys, chunked.keys), (whole.values, chunked.values)):
        assert a.shape == b.shape and a.parts.keys() == b.parts.keys()
        assert all(torch.equal(a.parts[p], b.parts[p]) for p in a.parts)
    assert [t.shape for t in whole.parts()] == [t.shape for t in chunked.parts()]
