"""Triton decode attention over encoded KV: the GPU counterpart of `decode_attention.cpp`.

One program per (batch row x KV head, split of the run's tokens) walks its tokens `BN` at a time:
it loads the codes and scales of the tile, decodes them in registers (E2M1 / E4M3 / E8M0 / integer
codes with fp16 scale and minimum, keys per token or grouped per channel), scores the tile against
every query head of the KV group and folds it into an online softmax. Each run of encoded tokens
(and the full-precision tail) gives partial (max, sum, output) states that `attend` merges, so no
layer is ever decoded whole. Sparse reads pass per-run rows (-1 = nothing). K and V each decode
with their own codec (`v=`), and a score bias per visible token (outlier key channels held apart)
is added before scaling.

Tested on the CPU under `TRITON_INTERPRET=1`; fast on a CUDA GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

F32, BF16, FP8, NVFP4, MXFP4, INT4, INT2, INT3 = range(8)


@triton.jit
def _e4m3(x):
    """uint8 E4M3 bit patterns (int32) -> float32 (no NaN: codecs saturate)."""
    e = (x >> 3) & 15
    m = (x & 7).to(tl.float32)
    v = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where((x & 128) != 0, -v, v)


@triton.jit
def _e2m1(c):
    """4-bit E2M1 codes (int32) -> float32."""
    m = c & 7
    mf = m.to(tl.float32)
    mag = tl.where(m < 4, mf * 0.5, tl.where(m == 7, 6.0, mf - 2.0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _half(x):
    """fp16 bit patterns (int32, 0..65535) -> float32 (finite values)."""
    sign = tl.where((x & 0x8000) != 0, -1.0, 1.0)
    e = (x >> 10) & 31
    man = (x & 1023).to(tl.float32)
    v = tl.where(e == 0, man * 5.960464477539063e-08, (1.0 + man / 1024.0) * tl.exp2((e - 15).to(tl.float32)))
    return sign * v


@triton.jit
def _decode(codes, scales, mins, tscale, rows, valid, bh, cs_bh, cs_t, ss_bh, ss_t, cs_d, ss_d, dim,
            D: tl.constexpr, KIND: tl.constexpr, CHANNEL: tl.constexpr, BLK: tl.constexpr):
    """Rows `rows: [BN]` of one (batch, head) of a run -> `[BN, D]` float32 (zeros where not valid).
    Token-major parts are `[bh, t, ...]` (strides cs_bh, cs_t); channel-grouped keys `[bh, d, t // BLK, ...]`
    (strides cs_bh, cs_d, cs_t per block)."""
    d = tl.arange(0, D)
    r = tl.where(valid, rows, 0)
    m2 = valid[:, None] & (d[None, :] < dim)
    if KIND == 0:  # float32
        return tl.load(
            codes.to(tl.pointer_type(tl.float32)) + bh * cs_bh + r[:, None] * cs_t + d[None, :], mask=m2,
            other=0.0,
        )
    if KIND == 1:  # bf16, loaded as its bits
        bits = tl.load(
            codes.to(tl.pointer_type(tl.uint16)) + bh * cs_bh + r[:, None] * cs_t + d[None, :], mask=m2,
            other=0,
        )
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    if KIND == 2:  # fp8 E4M3 + fp32 scale per block of BLK
        c = tl.load(codes + bh * cs_bh + r[:, None] * cs_t + d[None, :], mask=m2, other=0).to(tl.int32)
        s = tl.load(
            scales.to(tl.pointer_type(tl.float32)) + bh * ss_bh + r[:, None] * ss_t + (d // BLK)[None, :],
            mask=m2, other=0.0,
        )
        return _e4m3(c) * s
    if KIND == 3 or KIND == 4:  # NVFP4 / MXFP4: two E2M1 codes per byte, low nibble first
        byte = tl.load(codes + bh * cs_bh + r[:, None] * cs_t + (d // 2)[None, :], mask=m2, other=0).to(
            tl.int32
        )
        c = tl.where((d % 2 == 0)[None, :], byte & 15, byte >> 4)
        sb = tl.load(scales + bh * ss_bh + r[:, None] * ss_t + (d // BLK)[None, :], mask=m2, other=0).to(
            tl.int32
        )
        if KIND == 3:
            s = _e4m3(sb) * tscale
        else:
            s = tl.exp2((sb - 127).to(tl.float32))
        return _e2m1(c) * s
    # INT4 / INT2 / INT3 (KIND 5 / 6 / 7): x = min + code * scale, fp16 scale and min per group of BLK;
    # codes are one bit stream (element e at bits [e * BITS, (e + 1) * BITS)); an INT3 code may
    # straddle two bytes
    BITS: tl.constexpr = 4 if KIND == 5 else (3 if KIND == 7 else 2)
    if CHANNEL:  # keys grouped per channel: groups of BLK tokens along each channel
        blk = r // BLK
        bit = (r % BLK) * BITS
        at = codes + bh * cs_bh + d[None, :] * cs_d + blk[:, None] * cs_t + (bit // 8)[:, None]
        shift = (bit % 8)[:, None]
        off = bh * ss_bh + d[None, :] * ss_d + blk[:, None] * ss_t
    else:
        bit = d * BITS
        at = codes + bh * cs_bh + r[:, None] * cs_t + (bit // 8)[None, :]
        shift = (bit % 8)[None, :]
        off = bh * ss_bh + r[:, None] * ss_t + (d // BLK)[None, :]
    word = tl.load(at, mask=m2, other=0).to(tl.int32)
    if BITS == 3:
        word |= tl.load(at + 1, mask=m2 & (shift > 5), other=0).to(tl.int32) << 8
    code = (word >> shift) & ((1 << BITS) - 1)
    s = _half(tl.load(scales.to(tl.pointer_type(tl.uint16)) + off, mask=m2, other=0).to(tl.int32))
    lo = _half(tl.load(mins.to(tl.pointer_type(tl.uint16)) + off, mask=m2, other=0).to(tl.int32))
    return lo + code.to(tl.float32) * s


@triton.jit
def _fold(
    q, KC, KS, KM, VC, VS, VM, k_ts, v_ts, IDX, BIAS, bh, n, skip, start, per_split, dim, kc_bh, kc_t, ks_bh,
    ks_t, kc_d, ks_d, vc_bh, vc_t, vs_bh, vs_t, idx_bh, bias_n, bias_at, scaling, softcap, G: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, KKIND: tl.constexpr, VKIND: tl.constexpr, KCHAN: tl.constexpr,
    KBLK: tl.constexpr, VBLK: tl.constexpr, SPARSE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Tokens [start, start + per_split) of one (batch, head) `bh` of a run, scored by the query heads
    `q: [G, D]` -> the online softmax's (max, sum, output) state."""
    g = tl.arange(0, G)
    m = tl.full([G], float("-inf"), tl.float32)
    l_sum = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    for i in range(0, per_split, BN):
        offs = start + i + tl.arange(0, BN)
        valid = offs < n
        if SPARSE:
            rows = tl.load(IDX + bh * idx_bh + offs, mask=valid, other=-1)
            valid = valid & (rows >= 0)
        else:
            rows = offs + skip
        k = _decode(
            KC, KS, KM, k_ts, rows, valid, bh, kc_bh, kc_t, ks_bh, ks_t, kc_d, ks_d, dim, D, KKIND, KCHAN,
            KBLK,
        )
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BN]
        if HAS_BIAS:  # a score bias per visible token (outlier channels), before scaling
            at = bias_at + rows - skip
            s += tl.load(BIAS + (bh * G + g[:, None]) * bias_n + at[None, :], mask=valid[None, :], other=0.0)
        s = s * scaling
        if softcap > 0:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        corr = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = _decode(
            VC, VS, VM, v_ts, rows, valid, bh, vc_bh, vc_t, vs_bh, vs_t, 0, 0, dim, D, VKIND, False, VBLK
        )
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_sum = l_sum * corr + tl.sum(p, axis=1)
        m = m_new
    return m, l_sum, acc


@triton.jit
def _attend_run(
    Q, KC, KS, KM, VC, VS, VM, k_ts, v_ts, IDX, OM, OL, OA, BIAS, n, skip, per_split, dim, kc_bh, kc_t, ks_bh,
    ks_t, kc_d, ks_d, vc_bh, vc_t, vs_bh, vs_t, idx_bh, bias_n, bias_at, scaling, softcap, G: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, KKIND: tl.constexpr, VKIND: tl.constexpr, KCHAN: tl.constexpr,
    KBLK: tl.constexpr, VBLK: tl.constexpr, SPARSE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    q = tl.load(Q + (bh * G + g[:, None]) * D + d[None, :])  # [G, D]
    m, l_sum, acc = _fold(
        q, KC, KS, KM, VC, VS, VM, k_ts, v_ts, IDX, BIAS, bh, n, skip, split * per_split, per_split, dim,
        kc_bh, kc_t, ks_bh, ks_t, kc_d, ks_d, vc_bh, vc_t, vs_bh, vs_t, idx_bh, bias_n, bias_at, scaling,
        softcap, G, D, BN, KKIND, VKIND, KCHAN, KBLK, VBLK, SPARSE, HAS_BIAS,
    )
    base = (bh * nsplit + split) * G
    tl.store(OM + base + g, m)
    tl.store(OL + base + g, l_sum)
    tl.store(OA + (base + g[:, None]) * D + d[None, :], acc)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _flat(t: torch.Tensor | None, heads: int, like: torch.Tensor) -> torch.Tensor:
    """`[b, h, ...]` with a flat (b, h) index: stride(b) == h * stride(h); a 1-byte dummy when absent."""
    if t is None or t.numel() == 0:
        return torch.zeros(1, dtype=torch.uint8, device=like.device)
    if t.dim() >= 2 and t.stride(0) != heads * t.stride(1):
        t = t.contiguous()
    return t


def _run_args(parts: dict, channel: bool, heads: int, like):
    codes = parts.get("codes", parts.get("values"))
    codes = _flat(codes, heads, like)
    if codes.dtype in (torch.float32, torch.bfloat16):
        codes = codes.contiguous() if codes.stride(-1) != 1 else codes
    scales, mins = _flat(parts.get("scales"), heads, like), _flat(parts.get("mins"), heads, like)
    # element strides of the (b, h) index, the token (or token-block) axis, and the channel axis
    ax = 3 if channel else 2
    cs = (
        (codes.stride(1), codes.stride(ax), codes.stride(2) if channel else 0)
        if codes.dim() > 2
        else (0, 0, 0)
    )
    ss = (
        (scales.stride(1), scales.stride(ax), scales.stride(2) if channel else 0)
        if scales.dim() > 2
        else (0, 0, 0)
    )
    u8 = lambda t: t.view(torch.uint8) if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t  # noqa: E731
    return codes, u8(scales), mins, cs, ss


@dataclass
class Prepared:
    """One (query, runs, tail) problem as the kernels take it: the query heads of each KV group padded
    to `G x D`, the score bias likewise, and one `Item` per run (and the tail) with tokens to read."""

    q: torch.Tensor  # [b * h, G, D] float32
    bias: torch.Tensor  # [b * h, G, nb] float32, or a 1-element dummy
    nb: int
    items: list["Item"]
    shape: tuple[int, int, int, int]  # b, hq, g, dim


@dataclass
class Item:
    """One run of one problem: its kernel constants (`kinds`: KKIND, VKIND, KCHAN, KBLK, VBLK), parts,
    strides and extent, split `splits` ways of `per` tokens."""

    kinds: tuple
    parts: tuple  # kc, ks, km, vc, vs, vm
    strides: tuple  # kc_bh, kc_t, ks_bh, ks_t, kc_d, ks_d, vc_bh, vc_t, vs_bh, vs_t
    tscales: tuple[float, float]
    rows: torch.Tensor  # sparse positions `[b * h, n]` (int32), or a dummy
    n: int
    skip: int
    at: int  # where the run's first visible token sits among all visible tokens (the bias' index)
    splits: int
    per: int


def prepare(
    query: torch.Tensor, runs: list[tuple], tail_k: torch.Tensor, tail_v: torch.Tensor,
    idx: torch.Tensor | None = None, block: int = 32, bias: torch.Tensor | None = None,
) -> Prepared:
    """`attend`'s arguments -> what its kernel launches take (no kernel runs)."""
    b, hq, _, dim = query.shape
    h = tail_k.shape[1]
    g = hq // h
    G, D = _pow2(g), _pow2(dim)
    q = torch.zeros(b * h, G, D, dtype=torch.float32, device=query.device)
    q[:, :g, :dim] = query[:, :, 0].float().reshape(b * h, g, dim)
    tail = (
        F32, F32, False, {"values": tail_k.float().contiguous()}, {"values": tail_v.float().contiguous()}, 0,
        0, 1.0, 1.0, tail_k.shape[-2], 0,
    )
    if bias is not None:  # `[b * h, G, n]`: the query heads of a KV group padded to G
        nb = bias.shape[-1]
        bias_g = torch.zeros(b * h, G, nb, dtype=torch.float32, device=query.device)
        bias_g[:, :g] = bias.float().reshape(b * h, g, nb)
    else:
        nb, bias_g = 0, torch.zeros(1, dtype=torch.float32, device=query.device)
    items, start = [], 0
    for kkind, vkind, channel, kp, vp, kblk, vblk, kts, vts, length, skip in [*runs, tail]:
        visible = length - skip
        if idx is not None:
            local = idx.reshape(b * h, -1) - start
            inside = (local >= 0) & (local < visible)
            rows = torch.where(inside, local + skip, torch.full_like(local, -1)).to(torch.int32).contiguous()
            n = rows.shape[1]
        else:
            rows, n = torch.zeros(1, dtype=torch.int32, device=query.device), visible
        at, start = start, start + visible
        if n == 0:
            continue
        splits = max(1, min(32, n // (4 * block)))
        per = -(-n // splits)
        per = -(-per // block) * block
        kc, ks, km, kcs, kss = _run_args(kp, channel, h, q)
        vc, vs, vm, vcs, vss = _run_args(vp, False, h, q)
        items.append(Item(
            kinds=(kkind, vkind, channel, kblk, vblk), parts=(kc, ks, km, vc, vs, vm),
            strides=(kcs[0], kcs[1], kss[0], kss[1], kcs[2], kss[2], vcs[0], vcs[1], vss[0], vss[1]),
            tscales=(float(kts), float(vts)), rows=rows, n=n, skip=skip, at=at, splits=splits, per=per))
    return Prepared(q=q, bias=bias_g, nb=nb, items=items, shape=(b, hq, g, dim))


def merge(prep: Prepared, states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The items' split states `(max [bh, s, G], sum [bh, s, G], output [bh, s, G, D])`, in item order ->
    the attention output `[b, hq, dim]` float32."""
    b, hq, g, dim = prep.shape
    m = torch.cat([x[0] for x in states], 1)
    top = m.amax(1, keepdim=True)
    w = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - top))
    total = (torch.cat([x[1] for x in states], 1) * w).sum(1)
    out = (torch.cat([x[2] for x in states], 1) * w[..., None]).sum(1) / total[..., None]
    return out[:, :g, :dim].reshape(b, hq, dim)


def attend(
    query: torch.Tensor, runs: list[tuple], tail_k: torch.Tensor, tail_v: torch.Tensor, scaling: float,
    softcap: float | None = None, idx: torch.Tensor | None = None, block: int = 32,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`query: [b, hq, 1, d]` over `runs` — (k_kind, v_kind, channel, k_parts, v_parts, k_block,
    v_block, k_tscale, v_tscale, length, skip) per run, parts `[b, h, ...]` — then the tail
    `[b, h, t, d]`; `idx: [b, h, m]` positions over all of them (sorted) or None; `bias: [b, hq, n]`
    over every visible token, added to the scores before scaling. -> `[b, hq, d]` float32."""
    prep = prepare(query, runs, tail_k, tail_v, idx, block, bias)
    q = prep.q
    G, D = q.shape[1], q.shape[2]
    states = []
    for it in prep.items:
        om = torch.empty(q.shape[0], it.splits, G, device=q.device)
        ol = torch.empty_like(om)
        oa = torch.empty(q.shape[0], it.splits, G, D, device=q.device)
        kkind, vkind, channel, kblk, vblk = it.kinds
        _attend_run[(q.shape[0], it.splits)](
            q, *it.parts, *it.tscales, it.rows, om, ol, oa, prep.bias, it.n, it.skip, it.per,
            prep.shape[3], *it.strides, it.rows.stride(0) if idx is not None else 0, prep.nb, it.at,
            float(scaling), float(softcap or 0.0), G=G, D=D, BN=block, KKIND=kkind, VKIND=vkind,
            KCHAN=channel, KBLK=kblk, VBLK=vblk, SPARSE=idx is not None, HAS_BIAS=bias is not None,
        )
        states.append((om, ol, oa))
    return merge(prep, states)
