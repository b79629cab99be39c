"""Exact format rules from SPEC: E2M1 table and ties, MXFP4 / NVFP4 / FP8 / INT layouts and bytes."""

import pytest
import torch

from kvstrata import quantize
from kvstrata.codecs import get_codec
from kvstrata.codecs.e2m1 import E2M1_VALUES, decode_e2m1, encode_e2m1
from kvstrata.codecs.mxfp4 import floor_log2, pow2
from kvstrata.codecs.nvfp4 import tensor_scale


def test_e2m1_table_is_exact():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values[:8].tolist() == list(E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    # every representable value encodes to its own code (+0 for zero)
    assert encode_e2m1(values[:8]).tolist() == list(range(8))
    assert encode_e2m1(values[9:]).tolist() == list(range(9, 16))


@pytest.mark.parametrize(
    "x, expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_e2m1_ties_to_even(x, expected):
    for sign in (1.0, -1.0):
        got = decode_e2m1(encode_e2m1(torch.tensor([sign * x])))
        assert got.item() == sign * expected if expected else got.item() == 0.0


def test_e2m1_nearest_off_ties_and_saturation():
    x = torch.tensor([0.26, 0.74, 1.26, 2.51, 3.49, 5.01, 6.0, 7.9, 100.0, -1e9])
    assert decode_e2m1(encode_e2m1(x)).tolist() == [0.5, 0.5, 1.5, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0, -6.0]


def test_e2m1_zero_is_positive():
    assert encode_e2m1(torch.tensor([-0.0, -0.2, 0.0])).tolist() == [0, 0, 0]


def test_mxfp4_layout_and_scale_rule():
    x = torch.zeros(32)
    x[0] = 12.0  # floor(log2 12) = 3 -> shared_exp = 1 -> scale 2
    x[1] = 7.0  # 3.5 -> ties to 4 -> 8
    x[2] = 1.0  # 0.5
    q = quantize(x, "mxfp4")
    assert q.nbytes == 17
    assert q.parts["scales"].tolist() == [127 + 1]
    assert q.dequantize()[:4].tolist() == [12.0, 8.0, 1.0, 0.0]


def test_mxfp4_clips_6_to_8_range():
    x = torch.zeros(32)
    x[0], x[1] = 7.9, -7.9  # shared_exp 0 -> 7.9 in (6, 8) saturates to 6
    assert quantize(x, "mxfp4").dequantize()[:2].tolist() == [6.0, -6.0]


def test_mxfp4_bytes():
    assert quantize(torch.randn(4, 3, 64), "mxfp4").nbytes == 4 * 3 * 2 * 17
    assert quantize(torch.randn(10, 33), "mxfp4").nbytes == 10 * 2 * 17  # padded to whole blocks


def test_floor_log2_and_pow2_exact_including_subnormals():
    xs = torch.tensor([1.0, 1.5, 2.0, 3.99, 4.0, 2.0**-130, 2.0**-126, 3e38])
    assert floor_log2(xs).tolist() == [0, 0, 1, 1, 2, -130, -126, 127]
    e = torch.arange(-127, 128)
    assert torch.equal(pow2(e).double(), torch.pow(2.0, e.double()))


def test_nvfp4_bytes_and_scales():
    x = torch.randn(8, 64)
    q = quantize(x, "nvfp4")
    assert q.nbytes == 8 * 4 * 9 + 4
    assert quantize(x, "nvfp4:tensor_scale=0").nbytes == 8 * 4 * 9
    # the block holding the global max gets the largest E4M3 scale, 448
    scales = q.parts["scales"].view(torch.float8_e4m3fn).float()
    assert scales.max().item() == 448.0
    assert q.parts["tensor_scale"].item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)


def test_nvfp4_rows_encoded_apart_under_the_whole_scale_equal_the_whole():
    x = torch.randn(2, 3, 40, 16) * torch.linspace(0.1, 5, 40)[:, None]
    whole = quantize(x, "nvfp4").dequantize()
    scale = tensor_scale(x.abs().amax())
    parts = [get_codec("nvfp4").encode(x[..., a:b, :], scale).dequantize()
                       for a, b in [(0, 7), (7, 39), (39, 40)]]
    assert torch.equal(torch.cat(parts, -2), whole)
    assert not torch.equal(quantize(x[..., :7, :], "nvfp4").dequantize(),
                           whole[..., :7, :])  # their own scale differs


def test_nvfp4_block_max_maps_to_six():
    x = torch.randn(4, 16)
    d = quantize(x, "nvfp4").dequantize()
    # the largest element of each block survives within E4M3 scale precision (3 mantissa bits)
    rel = (d.abs().amax(-1) - x.abs().amax(-1)).abs() / x.abs().amax(-1)
    assert (rel <= 1 / 16 + 1e-6).all()


def test_fp8_per_token_and_block_bytes():
    x = torch.randn(5, 64)
    assert quantize(x, "fp8").nbytes == 5 * 64 + 5 * 4
    assert quantize(x, "fp8:block=32").nbytes == 5 * 64 + 10 * 4


def test_int_bytes():
    x = torch.randn(6, 64)
    assert quantize(x, "int4").nbytes == 6 * 32 + 6 * 2 * 4  # 2 groups of 32: codes + fp16 scale + fp16 min
    assert quantize(x, "int2").nbytes == 6 * 16 + 6 * 2 * 4
    assert quantize(x, "int2:group=64").nbytes == 6 * 16 + 6 * 4
    assert quantize(x, "int3").nbytes == 6 * 24 + 6 * 2 * 4  # 8 codes in 3 bytes


def test_int3_codes_straddle_bytes_and_decode_exactly():
    x = torch.arange(8.0).repeat(2, 4)  # every level 0..7, each in every position of its 3-byte word
    q = quantize(x, "int3")
    assert q.parts["codes"].shape[-1] == 12 and torch.equal(q.dequantize(), x)


def test_int_levels_exact():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 8])
    d = quantize(x, "int2").dequantize()
    assert torch.equal(d, x)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4", "int4", "int3", "int2"])
def test_zero_and_constant_blocks(fmt):
    z = torch.zeros(3, 64)
    assert torch.equal(quantize(z, fmt).dequantize(), z)
    c = torch.full((3, 64), 1.5)
    assert torch.equal(quantize(c, fmt).dequantize(), c)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4", "int4", "int3", "int2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(fmt, bad):
    x = torch.randn(2, 32)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, fmt)


def test_bad_specs_name_the_problem():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="unknown codec 'fp5'"):
        quantize(x, "fp5")
    with pytest.raises(ValueError, match="unknown parameter 'grup'"):
        quantize(x, "int4:grup=3")
    with pytest.raises(ValueError, match="group=.abc. is not a valid int"):
        quantize(x, "int4:group=abc")
    with pytest.raises(ValueError, match="positive multiple of 4"):
        quantize(x, "int2:group=6")
    with pytest.raises(ValueError, match="int3: group must be a positive multiple of 8"):
        quantize(x, "int3:group=12")
    with pytest.raises(TypeError):
        quantize([1.0, 2.0], "fp8")


def test_int_refuses_values_beyond_fp16_scale_range():
    with pytest.raises(ValueError, match="fp16"):
        quantize(torch.tensor([1e6, 0.0]), "int4")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4", "nvfp4", "int4", "int3", "int2"])
def test_empty_tensors_round_trip(fmt):
    x = torch.zeros(2, 0, 32)
    q = quantize(x, fmt)
    assert q.dequantize().shape == (2, 0, 32)


def _nvfp4_inputs():
    """Random rows at many magnitudes, exact E2M1 midpoints (ties) under a unit scale, zeros, a
    block whose scale underflows E4M3, odd widths (padded blocks), a slice and per-row tensor scales."""
    g = torch.Generator().manual_seed(11)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                         -0.25, -0.75, -5.0, 0.0, 6.0, 1e-3, -6.0, 3.0])
    spread = 10.0 ** torch.randint(-6, 6, (2, 3, 17, 1), generator=g)
    cases = [(torch.randn(2, 3, 17, 64, generator=g) * spread, None),
             (ties.reshape(1, 1, 1, 16), torch.tensor(1.0 / 448)), (torch.zeros(1, 2, 3, 32), None),
             (torch.cat([torch.full((1, 1, 1, 16), 1e-12), torch.full((1, 1, 1, 16), 100.0)], -1), None),
             (torch.randn(1, 2, 5, 40, generator=g), None),
             (torch.randn(2, 3, 40, 16, generator=g)[..., 7:39, :], None)]  # a slice: not contiguous
    rows = torch.randn(4, 2, 1, 64, generator=g) * torch.tensor([0.1, 1.0, 10.0, 300.0]).reshape(4, 1, 1, 1)
    cases.append((rows, torch.stack([tensor_scale(r.abs().amax() * 4) for r in rows]).reshape(4, 1, 1, 1)))
    return cases


@pytest.mark.parametrize("case", range(7))
def test_nvfp4_kernel_encode_equals_the_pytorch_codec_bit_for_bit(case, monkeypatch):
    """The C++ encode (used for a minmax fit on the CPU) gives the PyTorch path's codes and scales."""
    from kvstrata.codecs import nvfp4
    from kvstrata.read.kernels import cpu

    if cpu.load() is None:
        pytest.fail("the C++ kernel did not build on this machine")
    x, scale = _nvfp4_inputs()[case]
    for spec in ("nvfp4", "nvfp4:tensor_scale=0"):
        codec = get_codec(spec)
        got = codec.encode(x, scale)
        monkeypatch.setattr(nvfp4, "_native", lambda _: None)
        want = codec.encode(x, scale)
        monkeypatch.undo()
        assert got.parts.keys() == want.parts.keys()
        for name in want.parts:
            assert torch.equal(got.parts[name], want.parts[name]), (spec, name)
        assert torch.equal(got.dequantize(), want.dequantize())
