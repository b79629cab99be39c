"""E2M1 keys scored in integers (`KVSTRATA_KERNEL_SCORES=int8`, kernels/int8.h): exactly the reference's
attention for the query rounded to int8 per 16 values, within a stated bound of the float path, and
nothing else on the kernel changes."""

import pytest
import torch
from test_decode import _view

from kvstrata.read.decode import decode_attention
from kvstrata.read.kernels import cpu

pytestmark = pytest.mark.skipif(
    cpu.load() is None or not cpu.load().int8_scores(),
    reason="integer-domain scores need an AVX-512 VNNI build of the kernel")

# (batch, query heads, kv heads, head_dim): SmolLM2, Gemma-3, Qwen2.5-Coder-1.5B, -0.5B (7 heads per KV head)
SHAPES = [(1, 9, 3, 64), (2, 4, 1, 256), (1, 12, 2, 128), (1, 14, 2, 64)]
# runs of 300 (a ragged last 16-row block after its 5 skipped), 37 and 1 tokens
LENGTHS = (300, 37, 1)


def rounded(q: torch.Tensor) -> torch.Tensor:
    """The query as the kernel rounds it: per head and 16 values, to int8 steps of max |q| / 127."""
    x = q.reshape(*q.shape[:-1], q.shape[-1] // 16, 16)
    amax = x.abs().amax(-1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.zeros_like(amax))
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(x * inv).clamp(-127, 127) * step).reshape(q.shape)


def _sparse(view, tail, shape, seed=1):
    total = view.tokens + tail.shape[-2]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(total, generator=g)[:45].sort().values for _ in range(shape[2])])
    return idx[None].expand(shape[0], -1, -1)


@pytest.mark.parametrize("spec", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_scores_are_the_reference_for_the_rounded_query(spec, shape, monkeypatch):
    view, (tk, tv), q = _view(spec, shape, lengths=LENGTHS)
    idx = _sparse(view, tk, shape)
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "int8")
    got = [decode_attention(q, view, tk, tv, 0.1), decode_attention(q, view, tk, tv, 0.1, 5.0),
           decode_attention(q, view, tk, tv, 0.1, idx=idx)]
    # the full-precision tail is scored in float32 from the query as given: round it alike there
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "float")
    exact = [decode_attention(q, view, tk, tv, 0.1), decode_attention(q, view, tk, tv, 0.1, 5.0),
             decode_attention(q, view, tk, tv, 0.1, idx=idx)]
    ref = [decode_attention(rounded(q), view, tk, tv, 0.1, fused=False),
           decode_attention(rounded(q), view, tk, tv, 0.1, 5.0, fused=False),
           decode_attention(rounded(q), view, tk, tv, 0.1, fused=False, idx=idx)]
    for a, r, e in zip(got, ref, exact):
        # the encoded runs' scores are the rounded query's; the tail's 2 tokens are scored exactly,
        # so the bound is the tail's share of the query's rounding (0.4 % of |q| per 16 values)
        assert not torch.equal(a, e), "the int8 path was not taken"
        assert ((a - r).norm() / r.norm()).item() < 2e-3
        assert ((a - e).norm() / e.norm()).item() < 3e-2  # against the float scores: the stated bound


def test_int8_scores_without_a_tail_equal_the_rounded_reference(monkeypatch):
    """With no full-precision tail every score comes from the codes: the reference on the rounded
    query is matched to float32 rounding."""
    shape = (1, 12, 2, 128)
    view, _, q = _view("nvfp4", shape, lengths=LENGTHS)
    tk = tv = torch.zeros(1, 2, 0, 128)
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "int8")
    got = decode_attention(q, view, tk, tv, 0.1)
    ref = decode_attention(rounded(q), view, tk, tv, 0.1, fused=False)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["bf16", "fp8", "int4:r=0", "int4:r=0,keys=token", "int2:r=0"])
def test_other_codecs_are_untouched_by_int8_scores(spec, monkeypatch):
    view, (tk, tv), q = _view(spec, (1, 9, 3, 64), lengths=LENGTHS)
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "int8")
    got = decode_attention(q, view, tk, tv, 0.1)
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "float")
    assert torch.equal(got, decode_attention(q, view, tk, tv, 0.1))


def test_a_bad_scores_name_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("KVSTRATA_KERNEL_SCORES", "int3")
    with pytest.raises(ValueError, match="KVSTRATA_KERNEL_SCORES='int3'"):
        cpu.load()
