import pytest
import torch

from kvstrata.codecs.depth_dct import dct_matrix, depth_dct, depth_idct, low_energy_share, merge, split


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
def test_dct_is_orthonormal(g):
    c = dct_matrix(g)
    torch.testing.assert_close(c @ c.T, torch.eye(g, dtype=torch.float64))


def test_round_trip_exact_with_all_coefficients():
    x = torch.randn(4, 1, 2, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(depth_idct(depth_dct(x)), x)
    s = split(x, f=4, r=0.0)
    torch.testing.assert_close(merge(s), x)
    s = split(x, f=1, r=1.0, normalise=True)  # every residual kept: exact again
    torch.testing.assert_close(merge(s), x)


def test_equal_layers_live_in_the_lowest_frequency():
    layer = torch.randn(1, 2, 10, 8)
    x = layer.expand(4, -1, -1, -1, -1).clone()
    assert torch.allclose(low_energy_share(x, 1), torch.ones(2, 10))
    torch.testing.assert_close(merge(split(x, f=1, r=0.0)), x, atol=1e-5, rtol=0)


def test_residual_tokens_are_ranked_by_logit_impact():
    x = torch.zeros(2, 1, 1, 6, 4)
    x[1, 0, 0, 3] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # large residual, orthogonal to the queries
    x[1, 0, 0, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # small residual, aligned with them
    q = torch.zeros(2, 1, 1, 3, 4)
    q[..., 0] = 1.0
    s = split(x, f=1, r=1 / 6, queries=q)
    assert s.idx[1, 0, 0].tolist() == [1]
    assert split(x, f=1, r=1 / 6).idx[1, 0, 0].tolist() == [3]  # by norm without queries


def test_bad_parameters():
    x = torch.randn(4, 1, 1, 5, 2)
    with pytest.raises(ValueError, match="f must be"):
        split(x, f=0, r=0.1)
    with pytest.raises(ValueError, match="r must be"):
        split(x, f=1, r=2.0)
