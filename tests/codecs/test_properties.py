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
@given(x=tensors(), own=st.booleans(), factor=st.sampled_from([1.0, 4.0, 0.25]))
def test_nvfp4_round_trip_is_decode_of_encode(x, own, factor):
    """The unpacked shortcut (index rows held in NVFP4) reads back exactly what the codes do."""
    codec = NVFP4()
    scale = None if own else codec.scale_for(
        x.float().abs().amax() * factor if x.numel() else torch.zeros(()))
    expected = codec.decode(codec.encode(x, scale))
    assert torch.equal(codec.round_trip(x, scale), expected)
