"""`kvstrata.codecs.rotation` and the `rot=hadamard` option: exact in real arithmetic, no extra
bytes, fewer quantization errors where a few channels dominate."""

import pytest
import torch

from kvstrata import quantize
from kvstrata.codecs.rotation import Rotation, fwht, hadamard_rotation, rotate, unrotate
from kvstrata.methods import parse_method


def hadamard(d: int) -> torch.Tensor:
    """Sylvester's construction, by Kronecker products (the reference the transform must match)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


@pytest.mark.parametrize("d", [1, 2, 16, 64, 256])
def test_fwht_is_the_hadamard_transform_and_the_rotation_is_orthogonal(d):
    x = torch.randn(3, d, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ hadamard(d))
    r = hadamard_rotation(d, seed=3).double()
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(hadamard_rotation(d, 3), hadamard_rotation(d, 3))
    assert d < 4 or not torch.equal(hadamard_rotation(d, 3), hadamard_rotation(d, 4))


def test_attention_over_rotated_keys_and_values_is_plain_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 64, generator=g, dtype=torch.float64) for _ in range(3))
    r = hadamard_rotation(64).double()
    p = torch.softmax(q @ k.transpose(-1, -2) / 8, -1)
    p_rot = torch.softmax(rotate(q, r) @ rotate(k, r).transpose(-1, -2) / 8, -1)
    torch.testing.assert_close(p_rot, p)
    torch.testing.assert_close(unrotate(p_rot @ rotate(v, r), r), p @ v)


def test_rotation_spreads_outlier_channels():
    """Two channels 20x larger: rotated rows have a far lower peak-to-rms ratio, so a scale shared
    by a block of channels wastes fewer levels; with a uniform grid (INT4, one scale per 64) the
    error falls. Formats with fine blocks and exponents (NVFP4) gain less; the benchmark measures."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(512, 64, generator=g)
    k[:, [3, 17]] *= 20
    r = hadamard_rotation(64)
    crest = lambda x: (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean()  # noqa: E731
    assert crest(rotate(k, r)) < 0.5 * crest(k)
    plain = (quantize(k, "int4:group=64").dequantize() - k).pow(2).mean()
    rotated = (unrotate(quantize(rotate(k, r), "int4:group=64").dequantize(), r) - k).pow(2).mean()
    assert rotated < 0.5 * plain


def test_power_of_two_head_dim_and_clear_spec_errors():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotation(48)
    for spec, message in [("nvfp4:rot=random", "rot must be one of none, hadamard, got 'random'"),
                          ("nvfp4:rot=hadamard,rotseed=-1", "rotseed must be an integer"),
                          ("depth:g=2+bf16:rot=hadamard", "does not combine with depth sharing")]:
        with pytest.raises(ValueError, match=message):
            parse_method(spec)
    recipe = parse_method("int2:rot=hadamard,rotseed=7").full
    assert (recipe.transforms, recipe.r) == ((Rotation("hadamard", 7),), 128)
