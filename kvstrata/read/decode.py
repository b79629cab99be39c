"""Decode attention straight from encoded KV: one query token per sequence, every store codec.

`EncodedView` is what a cache layer holds at one decode step: runs of encoded tokens (each a K
and a V `QTensor` of the same tokens, the first `skip` hidden) plus the full-precision tail.
`decode_attention` attends one query over it: with the C++ kernel (`kernels/decode_attention.cpp`,
built on first use) codes are decoded a tile of tokens at a time inside an online softmax, and the
query heads of a KV group share one pass over the codes; without it (build failed, or
`KVSTRATA_KERNELS=reference`) the runs are decoded whole and attended (the reference path, also
what tests compare the kernels with). On a CUDA device the Triton kernels
(`kernels/triton_decode.py`) do the same. Sparse reads pass the positions to read (`idx`);
outlier key channels held apart enter as a score bias.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.codecs import QTensor
from kvstrata.codecs.transform import IDENTITY, Attend, Fitted, per_query_head
from kvstrata.read.kernels import cpu

# codec name -> kernel kind; elements per scale block along head_dim (None: the codec's own field)
_KINDS = {"bf16": (1, 0), "fp8": (2, None), "nvfp4": (3, 16), "mxfp4": (4, 32), "int4": (5, None),
          "int2": (6, None), "int3": (7, None)}
F32 = 0
_NONE = torch.empty(0)
_NO_IDX = torch.empty(0, dtype=torch.int64)


@dataclass(kw_only=True)
class EncodedView:
    """A layer's encoded tokens at one step. `runs`: (keys, values, skip) in token order, keys
    `[b, h, n, d]` (or `[b, h, d, n]` when `key_channel`: KIVI groups along tokens), values
    `[b, h, n, d]`; each `QTensor`'s own codec decodes it. `fitted`: the key transforms the codes
    were encoded through, with their state; `sink`: K, V `[b, h, s, d]` of the oldest tokens, held
    as they are (bf16) ahead of the runs. `generation` changes whenever held rows are rewritten."""

    key_channel: bool
    runs: list[tuple[QTensor, QTensor, int]]
    generation: int = 0
    fitted: Fitted = field(default=IDENTITY)
    sink: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def sink_tokens(self) -> int:
        return 0 if self.sink is None else self.sink[0].shape[-2]

    @property
    def run_tokens(self) -> int:
        return sum(k.shape[-1 if self.key_channel else -2] - skip for k, _, skip in self.runs)

    @property
    def tokens(self) -> int:
        """Visible tokens: the sink, then the runs."""
        return self.sink_tokens + self.run_tokens

    def side(self, name: str) -> torch.Tensor | None:
        """Side part `name` of every visible encoded token (the runs', in order); None without runs."""
        if not self.runs:
            return None
        return torch.cat([k.parts[name][:, :, skip:] for k, _, skip in self.runs], -2)

    def dense(self, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every visible token decoded, per run, the sink first: `[b, h, n, d]` K and V (the reference
        path)."""
        ks, vs = ([self.sink[0].to(dtype)], [self.sink[1].to(dtype)]) if self.sink is not None else ([], [])
        for run in self.runs:
            k, v = decode_run(run, self.key_channel, self.fitted, dtype)
            ks.append(k)
            vs.append(v)
        return ks, vs

    def key_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Visible key positions [start, stop) (the sink first) decoded, `[b, h, stop - start, d]`; only
        those rows are decoded (whole runs when keys are grouped per channel)."""
        out, s = [], self.sink_tokens
        if start < s:
            out.append(self.sink[0][..., start:min(stop, s), :].to(dtype))
        offset = s
        for k, _, skip in self.runs:
            n = (k.shape[-1] if self.key_channel else k.shape[-2]) - skip
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                a, b = skip + lo - offset, skip + hi - offset
                if self.key_channel:
                    rows = k.codec.decode(k).to(dtype).transpose(-1, -2)[..., a:b, :]
                    side = {name: k.parts[name][:, :, a:b] for name in self.fitted.side}
                else:
                    q = token_rows(k, a, b)
                    rows = q.codec.decode(q).to(dtype)
                    side = {name: q.parts[name] for name in self.fitted.side}
                out.append(self.fitted.inverse_keys(rows, side))
            offset += n
        return torch.cat(out, -2)


def decode_run(run: tuple[QTensor, QTensor, int], key_channel: bool, fitted: Fitted,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One run's visible tokens decoded, `[b, h, n, d]` K and V, `fitted`'s transforms undone
    (`IDENTITY`: as the codes hold them)."""
    k, v, skip = run
    kd = k.codec.decode(k).to(dtype)
    if key_channel:
        kd = kd.transpose(-1, -2)
    side = {name: k.parts[name][:, :, skip:] for name in fitted.side}
    return (fitted.inverse_keys(kd[..., skip:, :], side),
            fitted.inverse_values(v.codec.decode(v).to(dtype)[..., skip:, :]))


def token_rows(q: QTensor, a: int, b: int) -> QTensor:
    """Tokens [a, b) of a `[b, h, tokens, d]` QTensor whose codes and scales are per token (every
    part of 3+ dims has the tokens on dim 2; per-tensor parts stay whole)."""
    parts = {name: (p[:, :, a:b] if p.dim() >= 3 else p) for name, p in q.parts.items()}
    return QTensor(codec=q.codec, shape=(*q.shape[:2], b - a, *q.shape[3:]), dtype=q.dtype, parts=parts)


def _describe(q: QTensor, channel: bool, skip: int, d: int):
    """One QTensor as the kernels take it: ([codes, scales, mins], [kind, channel, length, skip,
    block], tensor scale)."""
    codec = q.codec
    kind, block = _KINDS[codec.name]
    if block is None:
        block = getattr(codec, "block", 0) or getattr(codec, "group", 0) or d
    parts = q.parts
    codes = parts.get("codes", parts.get("values"))
    length = q.shape[-1] if channel else q.shape[-2]
    ts = float(parts["tensor_scale"]) if "tensor_scale" in parts else 1.0
    return (
        [codes, parts.get("scales", _NONE), parts.get("mins", _NONE)],
        [kind, int(channel), length, skip, block], ts,
    )


def _tail(t: torch.Tensor):
    t = t.float()
    if t.stride(-1) != 1:
        t = t.contiguous()
    return [t, _NONE, _NONE], [F32, 0, t.shape[-2], 0, 0], 1.0


def kernel_args(view: EncodedView, tail_k: torch.Tensor, tail_v: torch.Tensor):
    """The C++ kernel's run descriptors for K and V: per side its parts (3 per run), its meta (5 ints
    per run, flat) and its tensor scales, as plain lists (no tensor is built per step)."""
    d = tail_k.shape[-1]
    out = []
    for which in (0, 1):
        parts, meta, ts = [], [], []
        for run in view.runs:
            p, m, s = _describe(run[which], view.key_channel and which == 0, run[2], d)
            parts += p
            meta += m
            ts.append(s)
        p, m, s = _tail(tail_k if which == 0 else tail_v)
        parts += p
        meta += m
        ts.append(s)
        out += [parts, meta, ts]
    return out


def triton_runs(view: EncodedView) -> list[tuple]:
    """`view`'s runs as `kernels.triton_decode.attend` takes them (K and V each with its own codec)."""
    out = []
    for k, v, skip in view.runs:
        d = v.shape[-1]
        _, (kkind, _, length, _, kblk), kts = _describe(k, view.key_channel, skip, d)
        _, (vkind, *_, vblk), vts = _describe(v, False, skip, d)
        out.append((kkind, vkind, view.key_channel, k.parts, v.parts, kblk, vblk, kts, vts, length, skip))
    return out


def reference_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
    softcap: float | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`query: [b, hq, 1, d]` over `keys, values: [b, hk, n, d]` (GQA) -> `[b, hq, d]` float32;
    `bias: [b, hq, n]` is added to the scores before scaling."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, 1)
    v = values.float().repeat_interleave(groups, 1)
    scores = query.float() @ k.transpose(-1, -2)
    scores = (scores if bias is None else scores + bias[:, :, None].float()) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores, -1) @ v)[:, :, 0]


def _sink_to_tail(view: EncodedView, a: Attend, idx: torch.Tensor | None):
    """The sink joins the full-precision tail (attention ignores key order): positions over
    [sink, runs, tail] become positions over [runs, sink, tail]; `idx` remapped and re-sorted."""
    s, m = view.sink_tokens, view.run_tokens
    if a.bias is not None:
        a.bias = torch.cat([a.bias[..., s:s + m], a.bias[..., :s], a.bias[..., s + m:]], -1)
    sk, sv = view.sink
    a.tail_k = torch.cat([sk.to(a.tail_k.dtype), a.tail_k], -2)
    a.tail_v = torch.cat([sv.to(a.tail_v.dtype), a.tail_v], -2)
    if idx is not None:
        idx = torch.where(idx < s, idx + m, torch.where(idx < s + m, idx - s, idx)).sort(-1).values
    return idx


def decode_attention(
    query: torch.Tensor, view: EncodedView, tail_k: torch.Tensor, tail_v: torch.Tensor, scaling: float,
    softcap: float | None = None, idx: torch.Tensor | None = None, fused: bool = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend `query: [b, hq, 1, d]` over `view`'s tokens followed by `tail_k, tail_v: [b, hk, t, d]`;
    `idx: [b, hk, m]` (sorted positions over that concatenation) reads only those; `bias: [b, hq, n]`
    (n: every visible token) is added to the scores before scaling. -> `[b, hq, d]`.

    The query, tail and bias are first moved into the codes' space by the view's transforms, one by
    one in pipeline order; their output fix-ups run in reverse."""
    a, idx, fixes = _enter(query, view, tail_k, tail_v, softcap, idx, bias)
    out = attend_codes(a.query, view, a.tail_k, a.tail_v, scaling, softcap, idx, fused, a.bias)
    return _leave(out, fixes)


def decode_attention_rows(
    queries: list[torch.Tensor], views: list[EncodedView], tails_k: list[torch.Tensor],
    tails_v: list[torch.Tensor], scaling: float, softcap: float | None = None,
    idxs: list[torch.Tensor | None] | None = None, fused: bool = True,
) -> list[torch.Tensor]:
    """`decode_attention` for many sequences of different lengths at once (a batched decode step:
    row i is `queries[i]` over `views[i]` + its tail, `idxs[i]` its sparse positions or None). On
    the CPU the kernel takes every row in one call (varlen, nothing padded), on a GPU the Triton kernel
    one launch per kind of run (`triton_varlen`); each row's result equals its own
    `decode_attention`. A codec the kernels do not know: the rows one by one."""
    idxs = idxs if idxs is not None else [None] * len(queries)
    entered = [_enter(q, v, k, t, softcap, i, None)
               for q, v, k, t, i in zip(queries, views, tails_k, tails_v, idxs)]
    known = fused and all(x.codec.name in _KINDS for v in views for run in v.runs for x in run[:2])
    if known and all(q.device.type == "cuda" for q in queries):
        from kvstrata.read.kernels import triton_varlen  # optional dependency: GPUs only

        attends = [a for a, _, _ in entered]
        outs = triton_varlen.attend_rows(
            [a.query for a in attends], [triton_runs(v) for v in views], [a.tail_k for a in attends],
            [a.tail_v for a in attends], scaling, softcap, [i for _, i, _ in entered],
            [a.bias for a in attends])
        return [_leave(out, fixes) for out, (_, _, fixes) in zip(outs, entered)]
    module = cpu.load() if known else None
    one_call = module is not None and all(q.device.type == "cpu" for q in queries)
    if not one_call:
        outs = [attend_codes(a.query, v, a.tail_k, a.tail_v, scaling, softcap, idx, fused, a.bias)
                for (a, idx, _), v in zip(entered, views)]
    else:
        rows = [[a.query[:, :, 0].float().contiguous(), *kernel_args(v, a.tail_k, a.tail_v),
                 _NO_IDX if idx is None else idx, _NONE if a.bias is None else a.bias.float()]
                for (a, idx, _), v in zip(entered, views)]
        q, kp, km, kt, vp, vm, vt, ix, bias = (list(col) for col in zip(*rows))
        outs = module.decode_attention_varlen(q, kp, km, kt, vp, vm, vt, float(scaling),
                                              float(softcap or 0.0), ix, bias)
    return [_leave(out, fixes) for out, (_, _, fixes) in zip(outs, entered)]


def _enter(query, view: EncodedView, tail_k, tail_v, softcap, idx, bias):
    """The query, tail, bias and positions moved into the codes' space: (Attend, idx, fix-ups)."""
    a = Attend(query=query, tail_k=tail_k, tail_v=tail_v, bias=bias, softcap=softcap,
               tokens=view.tokens + tail_k.shape[-2])
    if view.sink is not None:
        idx = _sink_to_tail(view, a, idx)
    return a, idx, view.fitted.enter(a, view.side)


def _leave(out: torch.Tensor, fixes) -> torch.Tensor:
    for fix in reversed(fixes):
        out = fix(out)
    return out


def attend_codes(
    query: torch.Tensor, view: EncodedView, tail_k: torch.Tensor, tail_v: torch.Tensor, scaling: float,
    softcap: float | None, idx: torch.Tensor | None, fused: bool, bias: torch.Tensor | None,
) -> torch.Tensor:
    """`decode_attention` over the codes as they are (no sink, query already in the codes' space):
    the C++ or Triton kernel, else decoded runs and `reference_attention`."""
    # a codec the kernels do not know: the reference path
    fused = fused and all(q.codec.name in _KINDS for run in view.runs for q in run[:2])
    if fused and query.device.type == "cuda":
        from kvstrata.read.kernels import triton_decode  # optional dependency: GPUs only

        runs = triton_runs(view)
        return triton_decode.attend(query, runs, tail_k, tail_v, scaling, softcap, idx, bias=bias)
    module = cpu.load() if fused else None
    if module is not None and query.device.type == "cpu":
        q = query[:, :, 0].float().contiguous()
        kp, km, kt, vp, vm, vt = kernel_args(view, tail_k, tail_v)
        return module.decode_attention(
            q, kp, km, kt, vp, vm, vt, float(scaling), float(softcap or 0.0), _NO_IDX if idx is None else idx,
            torch.empty(0) if bias is None else bias.float(),
        )
    ks, vs = _raw_runs(view)
    keys, values = torch.cat(ks + [tail_k.float()], -2), torch.cat(vs + [tail_v.float()], -2)
    if idx is not None:
        gather = idx[..., None].expand(-1, -1, -1, keys.shape[-1])
        keys, values = keys.gather(2, gather), values.gather(2, gather)
        if bias is not None:
            bias = bias.gather(-1, per_query_head(idx, query))
    return reference_attention(query, keys, values, scaling, softcap, bias)


def _raw_runs(view: EncodedView) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The runs decoded as the codes hold them (transforms not undone), `[b, h, n, d]` float32."""
    runs = [decode_run(run, view.key_channel, IDENTITY, torch.float32) for run in view.runs]
    return [k for k, _ in runs], [v for _, v in runs]


__all__ = ["EncodedView", "decode_attention", "decode_attention_rows", "decode_run", "per_query_head",
           "reference_attention"]
