"""Triton decode attention for many sequences of different lengths in one launch per kind of run: the
GPU counterpart of `decode_attention_varlen` (a batched decode step).

Each sequence's runs (and its tail) become items; items of the same kernel constants (codecs, key
axis, blocks, sparse or dense, with a score bias or without) share one launch whose programs read
their item's pointers, strides and extent from a table, each split exactly as the sequence's own
`triton_decode.attend` splits it, and the same `_fold` does the work. A sequence's states are merged
as its own call merges them, so each row equals its own call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.read.kernels.triton_decode import Prepared, _fold, merge, prepare

#: table columns: pointers (query, K codes / scales / mins, V codes / scales / mins, sparse rows, bias),
#: then n, skip, per, splits, 10 strides, idx_bh, bias_n, at
COLUMNS = 26


@triton.jit
def _ptr(T, at, kind: tl.constexpr):
    return tl.load(T + at).to(tl.pointer_type(kind))


@triton.jit
def _attend_items(
    T, FT, OM, OL, OA, H, dim, scaling, softcap, NT: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BN: tl.constexpr, KKIND: tl.constexpr, VKIND: tl.constexpr, KCHAN: tl.constexpr, KBLK: tl.constexpr,
    VBLK: tl.constexpr, SPARSE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    w = tl.program_id(0)  # item * H + KV head
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    item = w // H
    bh = w % H
    row = T + item * NT
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    q = tl.load(_ptr(row, 0, tl.float32) + (bh * G + g[:, None]) * D + d[None, :])
    splits = tl.load(row + 12)
    per = tl.load(row + 11)
    per_here = tl.where(split < splits, per, 0)  # splits past the item's own: an empty state
    m, l_sum, acc = _fold(
        q, _ptr(row, 1, tl.uint8), _ptr(row, 2, tl.uint8), _ptr(row, 3, tl.uint8), _ptr(row, 4, tl.uint8),
        _ptr(row, 5, tl.uint8), _ptr(row, 6, tl.uint8), tl.load(FT + item * 2), tl.load(FT + item * 2 + 1),
        _ptr(row, 7, tl.int32), _ptr(row, 8, tl.float32), bh, tl.load(row + 9), tl.load(row + 10),
        split * per, per_here, dim, tl.load(row + 13), tl.load(row + 14), tl.load(row + 15),
        tl.load(row + 16), tl.load(row + 17), tl.load(row + 18), tl.load(row + 19), tl.load(row + 20),
        tl.load(row + 21), tl.load(row + 22), tl.load(row + 23), tl.load(row + 24), tl.load(row + 25),
        scaling, softcap, G, D, BN, KKIND, VKIND, KCHAN, KBLK, VBLK, SPARSE, HAS_BIAS,
    )
    base = (w * nsplit + split) * G
    tl.store(OM + base + g, m)
    tl.store(OL + base + g, l_sum)
    tl.store(OA + (base + g[:, None]) * D + d[None, :], acc)


def attend_rows(
    queries: list[torch.Tensor], runs: list[list[tuple]], tails_k: list[torch.Tensor],
    tails_v: list[torch.Tensor], scaling: float, softcap: float | None = None,
    idxs: list[torch.Tensor | None] | None = None, biases: list[torch.Tensor | None] | None = None,
    block: int = 32,
) -> list[torch.Tensor]:
    """`triton_decode.attend` for each row i (`queries[i]: [1, hq, 1, d]` over `runs[i]` and its tail,
    `idxs[i]` / `biases[i]` or None), every row of a kind of run in one launch -> `[1, hq, d]` each."""
    n = len(queries)
    idxs, biases = idxs or [None] * n, biases or [None] * n
    if any(q.shape[0] != 1 for q in queries):
        raise ValueError("attend_rows takes one sequence per row (a batch of 1 each)")
    preps = [prepare(q, r, tk, tv, i, block, b)
             for q, r, tk, tv, i, b in zip(queries, runs, tails_k, tails_v, idxs, biases)]
    shapes = {(p.q.shape, p.shape[1:]) for p in preps}
    if len(shapes) > 1:
        raise ValueError(f"rows of one launch share heads and head size, got {sorted(map(str, shapes))}")
    launches: dict[tuple, list[tuple[int, int]]] = {}
    for r, prep in enumerate(preps):
        for j, it in enumerate(prep.items):
            launches.setdefault((it.kinds, idxs[r] is not None, biases[r] is not None), []).append((r, j))
    states: list[dict] = [{} for _ in preps]
    for (kinds, sparse, has_bias), members in launches.items():
        _launch(preps, members, kinds, sparse, has_bias, scaling, softcap, block, states)
    return [merge(prep, [s[j] for j in range(len(prep.items))]) for prep, s in zip(preps, states)]


def _launch(preps: list[Prepared], members: list[tuple[int, int]], kinds: tuple, sparse: bool, has_bias: bool,
            scaling: float, softcap: float | None, block: int, states: list[dict]) -> None:
    """One launch over `members` (row, item) of one kind; their states into `states[row][item]`."""
    first = preps[members[0][0]]
    h, G, D = first.q.shape
    rows, floats = [], []
    for r, j in members:
        prep, it = preps[r], preps[r].items[j]
        ptrs = [prep.q, *it.parts, it.rows, prep.bias]
        rows.append([t.data_ptr() for t in ptrs] + [it.n, it.skip, it.per, it.splits, *it.strides,
                                                    it.rows.stride(0) if sparse else 0, prep.nb, it.at])
        floats.append(list(it.tscales))
    dev = first.q.device
    table = torch.tensor(rows, dtype=torch.int64, device=dev)
    ftable = torch.tensor(floats, dtype=torch.float32, device=dev)
    assert table.shape[1] == COLUMNS
    nsplit = max(preps[r].items[j].splits for r, j in members)
    om = torch.empty(len(members) * h, nsplit, G, device=dev)
    ol = torch.empty_like(om)
    oa = torch.empty(len(members) * h, nsplit, G, D, device=dev)
    kkind, vkind, channel, kblk, vblk = kinds
    _attend_items[(len(members) * h, nsplit)](
        table, ftable, om, ol, oa, h, first.shape[3], float(scaling), float(softcap or 0.0), NT=COLUMNS, G=G,
        D=D, BN=block, KKIND=kkind, VKIND=vkind, KCHAN=channel, KBLK=kblk, VBLK=vblk, SPARSE=sparse,
        HAS_BIAS=has_bias,
    )
    for m, (r, j) in enumerate(members):
        s, span = preps[r].items[j].splits, slice(m * h, (m + 1) * h)
        states[r][j] = (om[span, :s], ol[span, :s], oa[span, :s])
