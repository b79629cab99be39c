"""The Triton decode-attention kernels, run on the CPU by Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU), equal decode-then-attend."""

import pytest
import torch

from kvstrata.hf.segments import encode_segment
from kvstrata.methods import parse_method
from kvstrata.read.decode import EncodedView, decode_attention, triton_runs
from kvstrata.read.kernels import triton_decode, triton_varlen

SPECS = ["bf16", "fp8", "fp8:block=32", "nvfp4", "mxfp4", "int4:r=0", "int2:r=0", "int3:r=0",
         "int4:r=0,keys=token", "int3:r=0,keys=token"]


def _setup(spec: str, shape: tuple, seed: int = 0):
    """A view of two runs (the first with 5 hidden tokens, the second with spare rows), a tail of 3
    tokens and a query."""
    b, hq, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    rec = parse_method(spec).full
    k, v = torch.randn(b, hk, 96, d, generator=g) * 2, torch.randn(b, hk, 96, d, generator=g)
    s1 = encode_segment(rec, k[..., :64, :], v[..., :64, :])
    s2 = encode_segment(rec, k[..., 64:, :], v[..., 64:, :], reserve=32)  # a run with spare rows
    view = EncodedView(key_channel=rec.key_axis == "channel",
                       runs=[(s1.keys, s1.values, 5), (s2.keys, s2.values, 0)])
    tk, tv = torch.randn(b, hk, 3, d, generator=g), torch.randn(b, hk, 3, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    total = view.tokens + 3
    idx = torch.stack([torch.randperm(total, generator=g)[:20].sort().values for _ in range(b * hk)])
    return view, tk, tv, q, idx.reshape(b, hk, 20), g


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1, 3, 1, 64), (2, 4, 2, 48)])
def test_triton_equals_reference(spec, shape):
    view, tk, tv, q, idx, _ = _setup(spec, shape)
    ref = decode_attention(q, view, tk, tv, 0.125, fused=False)
    torch.testing.assert_close(triton_decode.attend(
        q, triton_runs(view), tk, tv, 0.125), ref, rtol=1e-4, atol=1e-5)
    capped = decode_attention(q, view, tk, tv, 0.125, softcap=4.0, fused=False)
    torch.testing.assert_close(triton_decode.attend(q, triton_runs(view), tk, tv, 0.125, softcap=4.0), capped,
                               rtol=1e-4, atol=1e-5)
    ref = decode_attention(q, view, tk, tv, 0.125, idx=idx, fused=False)
    torch.testing.assert_close(triton_decode.attend(q, triton_runs(view), tk, tv, 0.125, idx=idx), ref,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["nvfp4:v=int2", "int2:r=0,v=nvfp4", "int4:r=0,v=int3", "fp8:v=mxfp4",
                                  "bf16"])
def test_triton_takes_mixed_codecs_and_a_score_bias(spec):
    """K and V in different codecs, and the score bias outlier channels add, dense and sparse."""
    shape = (2, 4, 2, 48)
    view, tk, tv, q, idx, g = _setup(spec, shape, seed=1)
    bias = torch.randn(2, 4, view.tokens + 3, generator=g) * 3
    for sparse in (None, idx):
        ref = decode_attention(q, view, tk, tv, 0.125, idx=sparse, fused=False, bias=bias)
        got = triton_decode.attend(q, triton_runs(view), tk, tv, 0.125, idx=sparse, bias=bias)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        plain = decode_attention(q, view, tk, tv, 0.125, idx=sparse, fused=False)
        assert (got - plain).abs().max() > 0.01  # the bias is not ignored


@pytest.mark.parametrize("specs", [("nvfp4", "nvfp4", "nvfp4", "nvfp4"),
                                   ("int4:r=0", "int4:r=0", "int4:r=0,keys=token", "fp8"),
                                   ("int2:r=0,v=nvfp4", "int2:r=0,v=nvfp4", "bf16", "int3:r=0")])
def test_triton_varlen_equals_each_rows_own_call(specs, monkeypatch):
    """A batched decode step's rows (different lengths, codecs, dense or sparse, with a score bias or
    without) in one launch per kind of run: each row equals its own `attend` call exactly."""
    rows = []
    for i, spec in enumerate(specs):
        view, tk, tv, q, idx, g = _setup(spec, (1, 4, 2, 48), seed=10 + i)
        if i < 2:  # dense rows of one kind; the second with a longer tail, so the extents differ
            idx = None
            n = 3 + 6 * i
            tk, tv = torch.randn(1, 2, n, 48, generator=g), torch.randn(1, 2, n, 48, generator=g)
        bias = torch.randn(1, 4, view.tokens + tk.shape[-2], generator=g) if i == 3 else None
        rows.append((q, triton_runs(view), tk, tv, idx, bias))
    launches = []
    real = triton_varlen._launch
    monkeypatch.setattr(triton_varlen, "_launch", lambda p, members, *a: (launches.append(members),
                                                                           real(p, members, *a)))
    for softcap in (None, 4.0):
        got = triton_varlen.attend_rows(*(list(c) for c in zip(*[r[:4] for r in rows])), 0.125, softcap,
                                        idxs=[r[4] for r in rows], biases=[r[5] for r in rows])
        for out, (q, runs, tk, tv, idx, bias) in zip(got, rows):
            want = triton_decode.attend(q, runs, tk, tv, 0.125, softcap, idx=idx, bias=bias)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert max(len({r for r, _ in m}) for m in launches) >= 2  # rows really shared a launch
