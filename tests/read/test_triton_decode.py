"""The Triton decode-attention kernels, run on the CPU by Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU), equal decode-then-attend."""

import pytest
import torch

from kvstrata.hf.segments import encode_segment
from kvstrata.methods import parse_method
from kvstrata.read.decode import EncodedView, decode_attention, triton_runs
from kvstrata.read.kernels import triton_decode

SPECS = ["bf16", "fp8", "fp8:block=32", "nvfp4", "mxfp4", "int4:r=0", "int2:r=0", "int4:r=0,keys=token"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1, 3, 1, 64), (2, 4, 2, 48)])
def test_triton_equals_reference(spec, shape):
    b, hq, hk, d = shape
    g = torch.Generator().manual_seed(0)
    rec = parse_method(spec).full
    k, v = torch.randn(b, hk, 96, d, generator=g) * 2, torch.randn(b, hk, 96, d, generator=g)
    s1 = encode_segment(rec, k[..., :64, :], v[..., :64, :])
    s2 = encode_segment(rec, k[..., 64:, :], v[..., 64:, :], reserve=32)  # a run with spare rows
    view = EncodedView(rec.codec, rec.key_axis == "channel", [
                       (s1.keys, s1.values, 5), (s2.keys, s2.values, 0)])
    tk, tv = torch.randn(b, hk, 3, d, generator=g), torch.randn(b, hk, 3, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    ref = decode_attention(q, view, tk, tv, 0.125, fused=False)
    torch.testing.assert_close(triton_decode.attend(
        q, triton_runs(view), tk, tv, 0.125), ref, rtol=1e-4, atol=1e-5)
    capped = decode_attention(q, view, tk, tv, 0.125, softcap=4.0, fused=False)
    torch.testing.assert_close(triton_decode.attend(q, triton_runs(view), tk, tv, 0.125, softcap=4.0), capped,
                               rtol=1e-4, atol=1e-5)
    total = view.tokens + 3
    idx = torch.stack([torch.randperm(total, generator=g)[
                      :20].sort().values for _ in range(b * hk)]).reshape(b, hk, 20)
    ref = decode_attention(q, view, tk, tv, 0.125, idx=idx, fused=False)
    torch.testing.assert_close(triton_decode.attend(q, triton_runs(view), tk, tv, 0.125, idx=idx), ref,
                               rtol=1e-4, atol=1e-5)
