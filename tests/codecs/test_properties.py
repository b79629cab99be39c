"""Every registered codec runs the contract suite (codec_contract.py); codec-specific properties."""

import pytest
import torch
from codec_contract import CodecContract, tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata import quantize
from kvstrata.codecs import NVFP4
from kvstrata.registry import classes


@pytest.fixture(scope="class", params=sorted(classes("store")))
def codec_name(request):
    return request.param


class TestRegisteredCodecs(CodecContract):
    """The whole contract, once per codec in the registry."""


def test_bf16_dtype_is_restored():
    x = torch.randn(2, 8, dtype=torch.float16)
    assert quantize(x, "bf16").dequantize().dtype == torch.float16


def test_fp8_block_whose_scale_underflows_encodes_as_zeros():
    x = torch.tensor([[1.4e-45, 0.0, -1.4e-45, 0.0]])
    q = quantize(x, "fp8")
    assert torch.equal(q.dequantize(), torch.zeros_like(x)) and float(q.parts["scales"]) == 1.0
    assert torch.equal(quantize(q.dequantize(), "fp8").parts["codes"], q.parts["codes"])


@settings(max_examples=60, deadline=None)
@given(x=tensors(), own=st.booleans(), factor=st.sampled_from([1.0, 4.0, 0.25]),
       fit=st.sampled_from(["minmax", "lsq"]))
def test_nvfp4_round_trip_is_decode_of_encode(x, own, factor, fit):
    """The unpacked shortcut (index rows held in NVFP4) reads back exactly what the codes do."""
    codec = NVFP4(fit=fit)
    scale = None if own else codec.scale_for(
        x.float().abs().amax() * factor if x.numel() else torch.zeros(()))
    expected = codec.decode(codec.encode(x, scale))
    assert torch.equal(codec.round_trip(x, scale), expected)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fmt=st.sampled_from([("int4:group=8", 8), ("int4:group=32", 32), ("int2:group=8", 8),
                                          ("int3:group=8", 8),
                                          ("int2:group=32", 32), ("nvfp4", 16)]))
def test_lsq_fit_is_never_worse_than_min_max_per_group(x, fmt):
    """`fit=lsq` keeps the min-max scales wherever its choice does not lower a group's squared error,
    and stores the same parts (shapes, dtypes): decoding does not know which fit encoded them."""
    spec, group = fmt
    plain = quantize(x, spec)
    fitted = quantize(x, f"{spec}{',' if ':' in spec else ':'}fit=lsq")
    for name, part in plain.parts.items():
        assert fitted.parts[name].shape == part.shape and fitted.parts[name].dtype == part.dtype
    pad = (-x.shape[-1]) % group
    err = [(q.dequantize().float() - x.float()) ** 2 for q in (plain, fitted)]
    # the fit sees a ragged last group padded with copies of its last element, as encoding pads it
    padded = [torch.cat([e, e[..., -1:].expand(*e.shape[:-1], pad)], -1) for e in err]
    blocks = [e.reshape(*e.shape[:-1], -1, group).sum(-1) for e in padded]
    assert (blocks[1] <= blocks[0] * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("spec", ["int4:group=96", "nvfp4:tensor_scale=1"])
def test_lsq_fit_lowers_the_error_of_gaussian_groups(spec):
    """On Gaussian data a scale set by the extremes wastes levels; choosing it for squared error
    clips them and the mean squared error drops (by over 10 % for INT4 in 96s and for NVFP4)."""
    x = torch.randn(64, 96 * 8, generator=torch.Generator().manual_seed(0))
    mse = [(quantize(x, f"{spec}{fit}").dequantize() - x).pow(2).mean() for fit in ("", ",fit=lsq")]
    assert mse[1] < 0.9 * mse[0]


@pytest.mark.parametrize("spec", ["int4:fit=mse", "nvfp4:fit=max"])
def test_an_unknown_fit_is_refused_with_a_clear_error(spec):
    with pytest.raises(ValueError, match="fit must be one of minmax, lsq"):
        quantize(torch.randn(4, 32), spec)


@given(bits=st.integers(1, 8), units=st.integers(0, 4), rows=st.integers(1, 3), data=st.data())
def test_bit_packing_round_trips_every_width(bits, units, rows, data):
    """Codes of any width 1..8 pack into `bits` bytes per 8 codes and unpack to themselves."""
    from kvstrata.codecs.blocks import codes_per_unit, pack_bits, unpack_bits

    n = units * codes_per_unit(bits)
    seed = data.draw(st.integers(0, 2**16))
    codes = torch.randint(0, 1 << bits, (rows, n), generator=torch.Generator().manual_seed(seed))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes.to(torch.uint8))
