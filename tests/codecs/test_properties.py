"""Properties every codec keeps: shape/dtype, idempotence, nbytes = what is held, error bounds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata import quantize
from kvstrata.codecs import CODECS

FORMATS = sorted(CODECS)
# worst-case relative error to the block's absolute max
BOUND = {"bf16": 2**-8, "fp8": 2**-3, "mxfp4": 0.5, "nvfp4": 0.25, "int4": 1 / 15 + 1e-3, "int2": 1 / 3 + 1e-3}


def tensors(max_rows=4, max_cols=80):
    shapes = st.tuples(st.integers(1, max_rows), st.integers(1, max_cols))
    return shapes.flatmap(
        lambda s: st.lists(
            st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=s[0] * s[1], max_size=s[0] * s[1]
        ).map(lambda v: torch.tensor(v, dtype=torch.float32).reshape(s))
    )


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=60, deadline=None)
@given(x=tensors())
def test_idempotent(fmt, x):
    q1 = quantize(x, fmt)
    q2 = quantize(q1.dequantize(), fmt)
    for name, part in q1.parts.items():
        if name == "tensor_scale":  # fp32 amax / 2688 may move by an ulp; codes and block scales may not
            torch.testing.assert_close(q2.parts[name], part, rtol=1e-6, atol=0)
        else:
            assert torch.equal(q2.parts[name], part), name
    torch.testing.assert_close(q2.dequantize(), q1.dequantize(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_shape_dtype_and_bytes_held(fmt, x):
    q = quantize(x, fmt)
    d = q.dequantize()
    assert d.shape == x.shape and d.dtype == x.dtype
    assert q.nbytes == sum(t.numel() * t.element_size() for t in q.parts.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_error_bounds(fmt):
    torch.manual_seed(0)
    block = {"mxfp4": 32, "nvfp4": 16, "int4": 32, "int2": 32}.get(fmt, 64)
    x = torch.randn(64, 64) * torch.logspace(-1, 1, 64)[:, None]  # within NVFP4 scale range
    d = quantize(x, fmt).dequantize()
    err = (d - x).abs().reshape(64, -1, block)
    amax = x.abs().reshape(64, -1, block).amax(-1, keepdim=True)
    assert (err <= BOUND[fmt] * amax + 1e-12).all()
    # and the typical error is far below the worst case
    assert (err / amax).mean() < BOUND[fmt] / 2


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
    codec = CODECS["nvfp4"]()
    scale = None if own else codec.scale_for(x.float().abs().amax() * factor if x.numel() else torch.zeros(()))
    expected = codec.decode(codec.encode(x, scale))
    assert torch.equal(codec.round_trip(x, scale), expected)
