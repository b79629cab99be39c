"""Top-k sparse decode reads: exactness at full k, schedule semantics, indexers, byte counts."""

import pytest
import torch

from kvstrata.hf import CompressedCache, topk_attention
from kvstrata.hf.layers import CompressedLayer
from kvstrata.hf.run import forward, generate
from kvstrata.hf.topk_attention import reading
from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer
from kvstrata.read import TopK, sparse
from kvstrata.read.indexers import (
    exact,
    held,
    hierarchical,
    index_row_bytes,
    index_rows,
    key_basis,
    lightning,
    lowrank,
    queries,
    relu_sum,
    score,
)
from kvstrata.read.kernels import cpu

IDS = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(2))


def decode(model, spec, steps=10):
    spec = parse_method(spec)
    cache = CompressedCache(model.config, spec)
    forward(model, IDS[:, :150], cache)
    with reading(model, cache, spec) as state:
        out = [forward(model, IDS[:, i : i + 1], cache) for i in range(150, 150 + steps)]
    return torch.cat(out, 1), state


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_k_covering_the_cache_equals_dense(arch, tiny_llama, tiny_gemma):
    model = tiny_llama if arch == "llama" else tiny_gemma
    dense, _ = decode(model, "nvfp4")
    sparse, state = decode(model, "topk:k=4096,schedule=F1U1R1+nvfp4")
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=0)
    assert state.steps == 10


def test_reuse_layers_read_the_source_layers_positions(tiny_llama):
    _, state = decode(tiny_llama, "topk:k=16,window=8,schedule=F1U3")
    assert list(state.modes.values()) == ["F", "U", "U", "U"]
    for layer in (1, 2, 3):
        assert torch.equal(state.picked[layer], state.picked[0])


def test_reindex_picks_among_the_source_candidates(tiny_llama):
    _, state = decode(tiny_llama, "topk:k=8,window=8,sinks=2,schedule=F1R3")
    fixed = set(range(2)) | set(range(159 - 8 + 1, 160))
    for layer in (1, 2, 3):
        for head in range(2):
            own = set(state.picked[layer][0, head].tolist()) - fixed
            assert own <= set(state.source["cand"][0, head].tolist())
            assert len(own) == 8


def test_every_selected_position_is_causal_and_in_budget(tiny_llama):
    _, state = decode(tiny_llama, "topk:k=12,window=16,sinks=4")
    for idx in state.picked.values():
        assert idx.max() < 160 and idx.min() >= 0
        assert idx.shape[-1] == 4 + 16 + 12
        assert (idx.diff(dim=-1) > 0).all()  # sorted, no duplicates


def test_bytes_read_are_counted_and_smaller_than_dense(tiny_llama):
    _, state = decode(tiny_llama, "topk:k=12,window=16,schedule=F1U3+fp8")
    sparse, dense = state.per_step()
    heads, layers = 2, 4
    kb, vb, ib = state.row_bytes[0]
    n_avg = sum(range(151, 161)) / 10
    assert dense == pytest.approx(n_avg * layers * heads * (kb + vb))
    # one Full layer scans every key; all four gather 32 entries per head
    assert sparse == pytest.approx(n_avg * heads * ib + layers * heads * 32 * (kb + vb))


def test_hierarchical_always_keeps_the_newest_block():
    scores = torch.randn(2, 3, 100)
    scores[..., 96:] = -100.0  # the newest (partial) block scores lowest
    idx = hierarchical(scores, k=44, block=8, blocks=6)  # 5 best full blocks + the newest one
    assert idx.shape == (2, 3, 44)
    for row in idx.reshape(-1, 44).tolist():
        assert set(range(96, 100)) <= set(row)
    top = hierarchical(scores, k=10, block=8, blocks=6)
    assert not set(range(96, 100)) & set(top.reshape(-1).tolist())  # a candidate, not forced into the top-k


def test_indexers_shapes_and_lightning_form():
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 50, 32)
    assert exact(q, k).shape == lightning(q, k).shape == (1, 2, 50)
    assert (lightning(q, k) >= 0).all()


def test_generate_with_sparse_reads(tiny_llama):
    g = generate(tiny_llama, byte_tokenizer(), IDS[:, :60], "topk:k=8,window=8+mxfp4", max_new_tokens=4)
    assert len(g.new_tokens) == 4
    cache = CompressedCache(tiny_llama.config, parse_method("mxfp4"))
    # entered before the prefill
    with reading(tiny_llama, cache, parse_method("topk:k=8,window=8+mxfp4")) as state:
        forward(tiny_llama, IDS[:, :60], cache)
        forward(tiny_llama, IDS[:, 60:61], cache)
    assert state.rows(0)[0] > 0 and state.per_step()[0] > 0  # row sizes measured once the layers hold data


def test_bad_read_specs():
    with pytest.raises(ValueError, match="schedule"):
        parse_method("topk:schedule=U1F1")
    with pytest.raises(ValueError, match="unknown indexer"):
        parse_method("topk:indexer=magic")
    assert TopK(schedule="F1R3").modes(6) == ["F", "R", "R", "R", "F", "R"]


def test_topk_overlap_matrix(tiny_llama):
    from kvstrata_lab.bench.topk_overlap import overlap_matrix

    layers, m = overlap_matrix(tiny_llama, IDS[:, :100], k=10, queries=4)
    assert layers == [0, 1, 2, 3] and m.shape == (4, 4)
    assert torch.allclose(m.diagonal(), torch.ones(4))
    assert ((m >= 0) & (m <= 1)).all()


def test_lowrank_index_finds_what_exact_finds_when_keys_are_low_rank():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 300, 16, generator=g) @ torch.randn(16, 64, generator=g)  # rank-16 keys
    q = torch.randn(1, 4, 1, 64, generator=g)
    basis = key_basis(k, 16)
    eye = basis.transpose(-1, -2) @ basis
    torch.testing.assert_close(eye, torch.eye(16).expand_as(eye), atol=1e-4, rtol=0)
    top_exact = exact(q, k).topk(20, -1).indices
    top_low = lowrank(q, k, basis).topk(20, -1).indices
    for h in range(2):  # FP4 index keys may swap near-ties; the bulk of the top-20 agrees
        assert len(set(top_exact[0, h].tolist()) & set(top_low[0, h].tolist())) >= 16
    with pytest.raises(ValueError, match="rank"):
        key_basis(k, 65)


def test_lowrank_index_rows_are_nvfp4_of_rank_dims(tiny_llama):
    assert index_row_bytes("lowrank", 64, 16, 128.0) == pytest.approx(9 + 4 / 256)  # 8 B codes + E4M3 scale
    assert index_row_bytes("lightning", 64, 16, 128.0) == 34  # two MXFP4 blocks
    assert index_row_bytes("exact", 64, 16, 128.0) == 128.0
    _, state = decode(tiny_llama, "topk:k=12,window=16,indexer=lowrank,rank=16")
    assert set(state.bases) == {0, 1, 2, 3}  # one basis per Full layer, fitted once
    with pytest.raises(ValueError, match="multiple of 16"):
        parse_method("topk:indexer=lowrank,rank=12")


def test_sparse_reads_over_depth_shared_layers_count_the_shared_entry_size(tiny_llama):
    _, plain = decode(tiny_llama, "topk:k=12,window=16")
    _, shared = decode(tiny_llama, "depth:g=2,f=1,mode=shared+topk:k=12,window=16")
    assert shared.row_bytes[0][0] < plain.row_bytes[0][0]
    assert shared.per_step()[0] < plain.per_step()[0]


@pytest.mark.parametrize(
    "spec",
    [
        "topk:k=12,window=2,indexer=lightning+nvfp4:r=8",
        "topk:k=12,window=2,indexer=lowrank,rank=16+nvfp4:r=6",
        "depth:g=2,f=1,r=0.05,block=4+topk:k=12,window=2,indexer=lightning",
    ],
)
def test_kept_index_rows_read_like_index_rows_computed_afresh(tiny_llama, monkeypatch, spec):
    """Index rows kept across decode steps select what rows recomputed every step select."""
    out, state = decode(tiny_llama, spec)
    assert all(rows > 0 for _, rows, _ in state.index.values())  # rows were kept (not a vacuous check)
    for layer, (_, rows, kept) in state.index.items():  # each kept row is the index row of the key held now
        keys = state.layers[layer].dense()[0][..., :rows, :]
        torch.testing.assert_close(
            kept[..., :rows, :], index_rows(state.cfg.indexer, keys, state.bases.get(layer)), atol=1e-5,
            rtol=0,
        )
    assert bool(state.held) == (state.cfg.indexer == "lowrank")
    for layer, (
        (_, scale), rows, kept,
    ) in state.held.items():  # NVFP4 rows kept under the scale they were held at
        index = index_rows("lowrank", state.layers[layer].dense()[0][..., :rows, :], state.bases[layer])
        torch.testing.assert_close(
            kept[..., :rows, :], held("lowrank", index, torch.tensor(scale)), atol=1e-5, rtol=0
        )
        tiles = state.tiles[layer]  # the kernel scores the same rows, transposed in tiles of 16
        assert torch.equal(tiles.transpose(-1, -2).flatten(2, 3)[:, :, :rows], kept[..., :rows, :])
        _, counted, top = state.amax[layer]  # the kept rows' largest magnitude, kept incrementally
        assert counted == rows
        torch.testing.assert_close(torch.as_tensor(top), index.abs().amax(), atol=1e-5, rtol=0)
    monkeypatch.setattr(
        CompressedLayer, "read_prefix", property(lambda self: (None, 0), lambda self, v: None), raising=False
    )
    # the prefilled cache's index: its basis fitted as before, its rows kept nowhere
    monkeypatch.setattr(topk_attention, "build_index",
                        lambda state, layer, k, prefix: sparse._raw_rows(state, layer, k, None))
    fresh, fresh_state = decode(tiny_llama, spec)
    assert not fresh_state.index
    for layer, idx in state.picked.items():
        assert torch.equal(idx, fresh_state.picked[layer])
    torch.testing.assert_close(out, fresh, atol=1e-5, rtol=0)
    assert state.bytes_read == fresh_state.bytes_read


@pytest.mark.parametrize("indexer", ["exact", "lightning", "lowrank"])
def test_the_kernel_picks_what_scores_and_topk_pick(indexer):
    g = torch.Generator().manual_seed(7)
    keys, q = torch.randn(2, 3, 300, 64, generator=g), torch.randn(2, 9, 1, 64, generator=g)
    basis = key_basis(keys, 16) if indexer == "lowrank" else None
    rows = held(indexer, index_rows(indexer, keys, basis)).float()
    ref = score(indexer, q, rows, basis)
    ref[..., :4] = float("-inf")
    ref[..., 290:] = float("-inf")
    got = cpu.load().topk_positions(queries(indexer, q, 3, basis).contiguous(), rows, 20, 4, 290,
                                    relu_sum(indexer))
    assert torch.equal(got, ref.topk(20, -1).indices.sort(-1).values)


def test_the_kernel_ranks_ties_by_position_and_nan_last():
    rows = torch.zeros(1, 1, 12, 16)
    rows[0, 0, 6] = float("nan")
    rows[0, 0, 9] = 1.0  # the one row scoring above 0
    top = cpu.load().topk_positions(torch.ones(1, 1, 2, 16), rows, 4, 5, 12, False)
    assert top.tolist() == [[[5, 7, 8, 9]]]  # 9, then the lowest tied positions; the NaN row never
    with pytest.raises(RuntimeError, match="1 <= k <= hi - lo"):
        cpu.load().topk_positions(torch.ones(1, 1, 2, 16), rows, 8, 5, 12, False)


@pytest.mark.parametrize("spec", ["topk:k=12,window=2,indexer=lowrank,rank=16+nvfp4",
                                  "topk:k=12,window=2,indexer=lightning+nvfp4",
                                  "topk:k=12,indexer=exact+fp8"])
def test_decode_steps_pick_in_the_kernel_what_they_pick_in_torch(tiny_llama, monkeypatch, spec):
    out, state = decode(tiny_llama, spec)
    monkeypatch.setattr(sparse, "_kernel_read", lambda *args: None)  # scored, selected, held in PyTorch
    monkeypatch.setattr(sparse, "_native_index", lambda rows: None)
    ref, ref_state = decode(tiny_llama, spec)
    assert all(torch.equal(idx, ref_state.picked[layer]) for layer, idx in state.picked.items())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert state.bytes_read == ref_state.bytes_read


def test_a_keep_policy_is_scored_inside_a_topk_read(tiny_llama):
    """The one attention function scores the prefill for SnapKV inside `reading()` too (the sparse
    function once left the layer waiting, and its next append refused)."""
    spec = "snapkv:keep=0.5+topk:k=8,window=4+nvfp4"
    cache = CompressedCache(tiny_llama.config, spec)
    with reading(tiny_llama, cache, spec) as state:
        forward(tiny_llama, torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2)), cache)
        assert not any(layer.pending_keep for layer in cache.layers)
        for _ in range(3):
            forward(tiny_llama, torch.tensor([[7]]), cache)
    assert cache.get_seq_length() == 43 and state.bytes_read > 0
    assert all(layer.stored_tokens() < 43 for layer in cache.layers)  # the policy dropped entries
