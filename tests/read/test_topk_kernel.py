"""The C++ top-k read kernels against the PyTorch path: index rows held in NVFP4 in place
(`hold_lowrank`), the k best positions with ties and a sampled threshold, and the positions a step
reads (sinks, picks, window) in one call."""

import pytest
import torch

from kvstrata.codecs.nvfp4 import tensor_scale
from kvstrata.read import TopK, sparse
from kvstrata.read.indexers import held
from kvstrata.read.kernels import cpu


@pytest.fixture(scope="module")
def kernel():
    module = cpu.load()
    if module is None:
        pytest.fail("the C++ kernel did not build (see the warning above)")
    return module


def rows_with_spread(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 32, generator=g) * torch.logspace(-3, 1, 32)


def tiles_for(rows: torch.Tensor) -> torch.Tensor:
    """A tile buffer for `rows` ([b, h, n, r] -> [b, h, ceil(n / 16), r, 16]), NaN until written."""
    b, h, n, r = rows.shape
    return torch.full((b, h, -(-n // 16), r, 16), float("nan"))


def transposed(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """The rows a tile buffer holds, `[b, h, n, r]`."""
    return tiles.transpose(-1, -2).flatten(2, 3)[:, :, :n]


def test_held_rows_are_the_codecs_round_trip_bit_for_bit(kernel):
    raw = rows_with_spread(50, 1)
    buf, tiles = torch.full_like(raw, float("nan")), tiles_for(raw)
    top, scale, first = kernel.hold_lowrank(raw, buf, tiles, 0, 40, 50, 0.0, 0, -1.0)
    assert first == 0
    assert top == raw[..., :40, :].abs().amax().item()  # the stable rows' largest magnitude
    assert scale == tensor_scale(raw.abs().amax()).item()  # the scale of every row held
    assert torch.equal(buf, held("lowrank", raw, torch.tensor(scale)))
    assert torch.equal(transposed(tiles, 50), buf)  # the same rows, transposed in tiles of 16


def test_rows_kept_under_their_scale_are_not_rounded_again(kernel):
    raw = rows_with_spread(64, 2)
    raw[..., 60:, :] *= 1e-3  # new rows smaller than the largest held: the scale holds
    buf, tiles = torch.zeros_like(raw), tiles_for(raw)
    top, scale, _ = kernel.hold_lowrank(raw, buf, tiles, 0, 60, 60, 0.0, 0, -1.0)
    sentinel = buf[..., :60, :].clone()
    top2, scale2, first = kernel.hold_lowrank(raw, buf, tiles, 60, 60, 64, top, 60, scale)
    assert (first, scale2, top2) == (60, scale, top)
    assert torch.equal(buf[..., :60, :], sentinel)
    assert torch.equal(buf, held("lowrank", raw, torch.tensor(scale)))
    assert torch.equal(transposed(tiles, 64), buf)
    raw[0, 1, 63, 5] = 1e4  # a new largest magnitude moves the scale: every row is rounded again
    _, scale3, first = kernel.hold_lowrank(raw, buf, tiles, 60, 60, 64, top, 60, scale)
    assert first == 0 and scale3 != scale
    assert torch.equal(buf, held("lowrank", raw, torch.tensor(scale3)))
    assert torch.equal(transposed(tiles, 64), buf)


def test_a_non_finite_row_is_refused_and_nothing_is_rounded(kernel):
    raw = rows_with_spread(20, 3)
    raw[1, 2, 17, 0] = float("inf")
    buf, tiles = torch.zeros_like(raw), tiles_for(raw)
    *_, first = kernel.hold_lowrank(raw, buf, tiles, 0, 20, 20, 0.0, 0, -1.0)
    assert first == -1 and not buf.any()
    with pytest.raises(RuntimeError, match="counted, stable <= n"):
        kernel.hold_lowrank(raw, buf, tiles, 0, 21, 20, 0.0, 0, -1.0)
    with pytest.raises(RuntimeError, match="tiles must be"):
        kernel.hold_lowrank(raw, buf, tiles[:, :, :1], 0, 20, 20, 0.0, 0, -1.0)


@pytest.mark.parametrize("n, k, levels", [(8192, 512, 0), (8192, 512, 5), (4000, 1999, 0), (600, 40, 3)])
def test_the_k_best_equal_a_stable_sort_whatever_the_ties(kernel, n, k, levels):
    """Lowest positions first among equal scores; `levels` > 0 makes most scores tie (the sampled
    threshold then passes more than k, or fewer, and the selection still ends exact)."""
    g = torch.Generator().manual_seed(n + k)
    rows = (torch.randn(1, 2, n, 16, generator=g) * 8).round() / 8  # sums exact in any order
    if levels:
        rows = rows.round().clamp(-levels, levels)
    q = torch.ones(1, 2, 1, 16)
    got = kernel.topk_positions(q, rows, k, 4, n - 64, False)
    tiles = torch.full((1, 2, -(-n // 16) * 16, 16), float("nan"))  # padding never scored into a pick
    tiles[:, :, :n] = rows
    tiles = tiles.unflatten(2, (-1, 16)).transpose(-1, -2).contiguous()  # the same rows, tiled
    assert torch.equal(kernel.topk_positions(q, tiles, k, 4, n - 64, False), got)
    scores = (rows @ q[0, :, 0, :, None])[..., 0][..., 4:n - 64]
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k] + 4
    assert torch.equal(got, order.sort(-1).values)


def test_read_positions_are_sinks_picks_and_window_ascending(kernel):
    g = torch.Generator().manual_seed(5)
    rows, q = torch.randn(2, 3, 700, 16, generator=g), torch.randn(2, 3, 3, 16, generator=g)
    top = kernel.topk_positions(q, rows, 50, 4, 636, False)
    got = kernel.read_positions(q, rows, 50, 4, 636, 700, False)
    fixed = torch.cat([torch.arange(4), torch.arange(636, 700)]).expand(2, 3, -1)
    assert torch.equal(got, torch.cat([fixed, top], -1).sort(-1).values)
    with pytest.raises(RuntimeError, match="end >= hi"):
        kernel.read_positions(q, rows, 50, 4, 636, 600, False)


def held_in_torch(state, layer, rows, prefix, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sparse, "_native_index", lambda rows: None)
        return sparse._held_rows(state, layer, rows, prefix)


def test_index_rows_kept_in_place_equal_the_torch_path_across_growth_and_generations(kernel, monkeypatch):
    """Decode steps one row at a time past the buffers' growth (kept rows not a whole tile), a scale
    change, a step with nothing kept (generation None) and a new generation: the rows held in place,
    and their tiles, equal what the PyTorch path holds."""
    ours, ref = (sparse.ReadState(cfg=TopK(k=4, indexer="lowrank"), modes={0: "F"}) for _ in range(2))
    raw = rows_with_spread(400, 4)[:1, :2, :, :16].contiguous()
    steps = [(gen, n) for gen, n in [(1, 37), (1, 38), (1, 39)] + [(1, m) for m in range(40, 140, 7)]
             + [(None, 150), (1, 151), (2, 152), (2, 153)]]
    raw[0, 1, 100, 3] = 50.0  # a new largest magnitude, reached mid-way: every row rounded again
    for gen, n in steps:
        prefix = None if gen is None else (gen, n - 1)  # the newest row not stable yet
        got = sparse._held_rows(ours, 0, raw[..., :n, :], prefix)
        want = held_in_torch(ref, 0, raw[..., :n, :], prefix, monkeypatch)
        assert torch.equal(got, want), (gen, n)
        if gen is not None:
            assert torch.equal(transposed(ours.tiles[0], n), got), (gen, n)
            assert float(ours.amax[0][2]) == float(ref.amax[0][2])
    assert ours.tiles[0].shape[2] * 16 >= 153 and ours.held[0][2].shape[-2] > 37  # the buffers grew
