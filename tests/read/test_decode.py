"""Decode attention straight from encoded KV equals decode-then-attend, for every registered codec."""

import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvstrata.codecs import Center, Rotation, Smooth
from kvstrata.codecs.transform import Fitted
from kvstrata.hf import CompressedCache
from kvstrata.hf import rows as attn
from kvstrata.hf.run import cache_kwarg, forward
from kvstrata.hf.segments import encode_segment
from kvstrata.methods import METHODS, parse_method
from kvstrata.read import decode
from kvstrata.read.decode import EncodedView, decode_attention
from kvstrata.read.kernels import cpu

STORE = [n for n, e in METHODS.items() if e.stratum == "store"]
SPECS = [f"{n}:r=0" if e.defaults.get("keys") == "channel" else n for n,
                                      e in METHODS.items() if e.stratum == "store"]
SPECS += ["int4:r=0,keys=token", "int2:group=16,r=8", "int3:keys=token,group=16,r=8", "fp8:block=32",
           "nvfp4;sliding=fp8", "mxfp4:r=5"]
# depth-shared layers whose heads are all exact read their codes too (tiny Gemma-3 has one global
# layer, so no group forms there and its layers stay per-layer)
MODEL_SPECS = SPECS + ["depth:g=2,mode=exact,block=8+nvfp4", "depth:g=4,mode=exact,block=16+int4:r=0",
                       # sink tokens, centered keys, and a ragged last key group in the prefill
                       "nvfp4:sink=4,center=1,rot=hadamard", "int4:group=16,r=0,sink=2",
                       "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3,center=1,rot=hadamard",
                       # least-squares scales, INT4 values per token in groups of their own
                       "int4:keys=channel,group=16,r=0,v=int4,vgroup=8,fit=lsq,sink=2,rot=hadamard",
                       "int3:keys=channel,group=16,r=0,v=int3,vgroup=16,fit=lsq,sink=2,rot=hadamard"]
# shapes: (batch, query heads, kv heads, head_dim) as SmolLM2 (GQA 3) and Gemma-3 (GQA 4, d = 256) have them
SHAPES = [(1, 9, 3, 64), (2, 4, 1, 256), (1, 2, 2, 48)]


def test_the_kernel_builds_here():
    assert cpu.load() is not None, "the C++ decode kernel must build on this machine (gcc is there)"
    assert cpu.load().isa() == cpu.expected_isa(), "the default build takes the best path this CPU has"


@pytest.fixture(params=cpu.runnable_isas())
def isa(request, monkeypatch):
    """Each decode path (AVX-512, AVX2, scalar) this machine can run, as the kernel every call loads."""
    module = cpu.load(isa=request.param)
    assert module is not None and module.isa() == cpu.expected_isa(request.param)
    monkeypatch.setattr(cpu, "load", lambda *args, **kwargs: module)
    return module.isa()


def test_a_bad_isa_name_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("KVSTRATA_KERNEL_ISA", "avx9000")
    with pytest.raises(ValueError, match="KVSTRATA_KERNEL_ISA='avx9000'"):
        cpu.chosen_isa()


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    """torch's lock file, left in the build directory by a process killed mid-build, made every
    later process wait on it forever."""
    assert cpu.load() is not None
    built = cpu._cache_root() / cpu.build_key()
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (copy / "lock").touch()  # as a killed holder leaves it
    env = {**os.environ, "KVSTRATA_CACHE": str(tmp_path)}
    code = "from kvstrata.read.kernels import cpu; assert cpu.load() is not None"
    subprocess.run([sys.executable, "-c", code], env=env, timeout=240, check=True)
    assert not (copy / "lock").exists()


def _view(spec, shape, seed=0, lengths=(64, 37, 1)):
    b, hq, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    rec = parse_method(spec).full
    runs, fitted = [], None
    for n in lengths:  # channel-grouped keys end on a ragged group where n is not a multiple
        k, v = torch.randn(b, hk, n, d, generator=g) * 3, torch.randn(b, hk, n, d, generator=g)
        fitted = fitted or Fitted.fit(rec.transforms, k)  # fitted on the first run, as a layer does
        seg = encode_segment(rec, k, v, fitted)
        runs.append((seg.keys, seg.values, min(5, n - 1) if len(runs) == 0 else 0))
    tail = [torch.randn(b, hk, 2, d, generator=g) for _ in range(2)]
    q = torch.randn(b, hq, 1, d, generator=g)
    return EncodedView(key_channel=rec.key_axis == "channel", runs=runs, fitted=fitted), tail, q


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_decode_then_attend(spec, shape, isa):
    view, (tk, tv), q = _view(spec, shape)
    ref = decode_attention(q, view, tk, tv, 0.1, fused=False)
    got = decode_attention(q, view, tk, tv, 0.1)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    capped = decode_attention(q, view, tk, tv, 0.1, softcap=5.0)
    torch.testing.assert_close(capped, decode_attention(q, view, tk, tv, 0.1, softcap=5.0, fused=False),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(cpu.expected_isa() != "avx512", reason="the in-register reads are AVX-512 code")
@pytest.mark.parametrize("shape", SHAPES + [(1, 12, 2, 128), (1, 14, 2, 64)])
def test_reading_codes_in_registers_equals_the_buffered_tiles_bit_for_bit(shape, monkeypatch):
    """Scores and value sums taken from the codes in registers (no decoded tile written) are the
    buffered path's, bit for bit, dense and sparse: every committed number stands."""
    fused, buffered = cpu.load(isa="native"), cpu.load(isa="buffered")
    assert fused.reads_in_registers() and not buffered.reads_in_registers()
    for spec in SPECS + ["fp8:block=16", "int4:r=0,keys=token,group=128", "int2:r=0,keys=token"]:
        view, (tk, tv), q = _view(spec, shape, seed=4)
        total = view.tokens + tk.shape[-2]
        g = torch.Generator().manual_seed(5)
        idx = torch.stack([torch.randperm(total, generator=g)[:40].sort().values for _ in range(shape[2])])
        got = {}
        for name, module in (("fused", fused), ("buffered", buffered)):
            monkeypatch.setattr(cpu, "load", lambda *a, module=module, **k: module)
            got[name] = [decode_attention(q, view, tk, tv, 0.1), decode_attention(q, view, tk, tv, 0.1, 5.0),
                         decode_attention(q, view, tk, tv, 0.1, idx=idx[None].expand(shape[0], -1, -1))]
        for a, b in zip(got["fused"], got["buffered"]):
            assert torch.equal(a, b), spec


@pytest.mark.parametrize("spec", ["nvfp4", "int4:r=0", "nvfp4:smooth=0.5,rot=hadamard"])
def test_centered_keys_attend_as_the_keys_they_decode_to(spec):
    """Codes holding K - m: the fused path shifts every score by q.m (a softcap bends that shift,
    so it is added back there) and equals attending over the decoded keys."""
    view, (tk, tv), q = _view(spec.split(":")[0] + (":r=0" if spec.startswith("int4") else ""), (1, 9, 3, 64))
    pipeline = [(Center(True), {"mean": torch.randn(1, 3, 1, 64) * 4})]
    pipeline += [(Smooth(0.5), {"scale": torch.rand(1, 3, 1, 64) + 0.5})] if "smooth" in spec else []
    pipeline += [(Rotation("hadamard"), {})] if "rot" in spec else []
    view = replace(view, fitted=Fitted(*map(tuple, zip(*pipeline))))
    ks, vs = view.dense()
    keys, values = torch.cat(ks + [tk], -2), torch.cat(vs + [tv], -2)
    for cap in (None, 5.0):
        ref = decode.reference_attention(q, keys, values, 0.1, cap)
        torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, cap), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, cap, fused=False), ref,
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_key_rows_decode_only_the_rows_asked_for(spec):
    view, _, _ = _view(spec, (2, 4, 2, 32), seed=2)
    keys = torch.cat(view.dense()[0], -2)
    for a, b in [(0, 1), (3, 70), (59, 60), (60, view.tokens), (0, view.tokens)]:
        torch.testing.assert_close(view.key_rows(a, b), keys[..., a:b, :], rtol=0, atol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_sparse_positions_read_only_those(spec, isa):
    view, (tk, tv), q = _view(spec, (1, 9, 3, 64), seed=1)
    total = view.tokens + tk.shape[-2]
    g = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(total, generator=g)[:30].sort().values for _ in range(3)])[None]
    ref = decode_attention(q, view, tk, tv, 0.1, idx=idx, fused=False)
    torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, idx=idx), ref, rtol=1e-4, atol=1e-5)
    # reading every position is dense attention
    every = torch.arange(total).expand(1, 3, total)
    torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, idx=every),
                               decode_attention(q, view, tk, tv, 0.1), rtol=1e-4, atol=1e-5)


MODEL_ROW_SPECS = ["nvfp4:sink=4,center=1,rot=hadamard",
                   "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3,center=1"]


@pytest.mark.parametrize("spec", SPECS + MODEL_ROW_SPECS)
def test_varlen_rows_equal_one_call_per_row(spec, isa):
    """A batched decode step: rows of different lengths (and sparse positions on one) in one kernel
    call give each row exactly what its own call gives; the reference path agrees."""
    rows = [_view(spec, (1, 9, 3, 64), seed=s, lengths=n) for s, n in
            enumerate([(64, 37, 1), (5,), (130, 64), (64, 37, 1)])]
    views, tails, qs = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    if "sink" in spec:  # one row holds its oldest tokens in bf16 apart from the runs
        views[1] = replace(views[1], sink=tuple(torch.randn(1, 3, 4, 64) for _ in range(2)))
    total = views[3].tokens + 2
    idx = torch.stack([torch.randperm(total, generator=torch.Generator().manual_seed(h))[:20].sort().values
                       for h in range(3)])[None]
    idxs = [None, None, None, idx]
    args = ([t[0] for t in tails], [t[1] for t in tails], 0.1)
    for cap in (None, 5.0):
        got = decode.decode_attention_rows(qs, views, *args, softcap=cap, idxs=idxs)
        ref = decode.decode_attention_rows(qs, views, *args, softcap=cap, idxs=idxs, fused=False)
        for i, (q, v, (tk, tv)) in enumerate(zip(qs, views, tails)):
            one = decode_attention(q, v, tk, tv, 0.1, cap, idx=idxs[i])
            torch.testing.assert_close(got[i], one, rtol=0, atol=0)
            torch.testing.assert_close(ref[i], one, rtol=1e-4, atol=1e-5)


def test_kernel_kinds_cover_every_codec():
    assert set(STORE) <= set(decode._KINDS), "a registered codec has no decode-attention kind"


def _decode_logits(model, spec, fused, steps=12, prefill=40):
    ids = torch.randint(0, 256, (1, prefill + steps), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(model.config, spec, fused=fused)
    out = [forward(model, ids[:, :prefill], cache)]
    for i in range(prefill, prefill + steps):
        out.append(forward(model, ids[:, i : i + 1], cache))
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("spec", MODEL_SPECS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_logits_fused_equal_reference(spec, arch, tiny_llama, tiny_gemma, monkeypatch):
    model = tiny_llama if arch == "llama" else tiny_gemma
    calls = []
    real = decode.decode_attention_rows

    def counted(queries, *a, **k):  # one entry per row read from its codes
        calls.extend([k.get("fused", True)] * len(queries))
        return real(queries, *a, **k)

    monkeypatch.setattr(attn, "decode_attention_rows", counted)
    got, cache = _decode_logits(model, spec, fused=True)
    assert len(calls) == 12 * len(cache.layers), "every decode step of every layer reads the encoded view"
    ref, ref_cache = _decode_logits(model, spec, fused=False)
    assert len(calls) == 12 * len(cache.layers), "the reference path decodes and attends densely"
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert cache.nbytes() == ref_cache.nbytes() and cache.get_seq_length() == ref_cache.get_seq_length()


def test_decode_steps_append_in_place(tiny_llama):
    """A decode step encodes its token into the last segment's spare rows: segments stay few."""
    _, cache = _decode_logits(tiny_llama, "nvfp4", fused=True, steps=30)
    for layer in cache.layers:
        assert len(layer.segments) <= 3  # the prefill, then one segment with room for 64 tokens
        assert sum(s.visible for s in layer.segments) == 70


@pytest.mark.parametrize("spec", ["fp8", "fp8:sink=4", "fp8:sink=8"])
def test_a_padding_mask_falls_back_to_the_reference(tiny_llama, spec):
    """The mask's columns follow positions: sink tokens (the padded row's pads among them) first."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    outs = []
    for fused in (True, False):
        cache = CompressedCache(tiny_llama.config, spec, fused=fused)
        with torch.inference_mode():
            out = tiny_llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                      pad_token_id=0, **{cache_kwarg(tiny_llama): cache})
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("spec", ["nvfp4+topk:k=8,schedule=F1,indexer=lowrank,rank=16",
                                  "int4:r=0+topk:k=8,schedule=F1R1,indexer=lightning",
                                  "bf16+topk:k=8,schedule=F1U1,indexer=exact"])
def test_sparse_reads_from_codes_equal_gathering_from_dense(spec, tiny_llama, monkeypatch):
    from kvstrata.hf.layers import CompressedLayer
    from kvstrata.hf.topk_attention import reading

    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(5))
    results = {}
    for fused in (True, False):
        cache = CompressedCache(tiny_llama.config, spec, fused=fused)
        dense_calls = []
        real_dense = CompressedLayer.dense
        with reading(tiny_llama, cache, parse_method(spec)) as state:
            out = [forward(tiny_llama, ids[:, :48], cache)]
            monkeypatch.setattr(CompressedLayer, "dense",
                                lambda self: dense_calls.append(1) or real_dense(self))
            for i in range(48, 60):
                out.append(forward(tiny_llama, ids[:, i : i + 1], cache))
            monkeypatch.setattr(CompressedLayer, "dense", real_dense)
        results[fused] = (torch.cat(out, 1), state.bytes_read, state.picked, len(dense_calls))
    got, ref = results[True], results[False]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    assert got[1] == ref[1]
    assert all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])
    assert got[3] == 0 and ref[3] > 0  # the fused path never builds a dense copy of a layer


@pytest.mark.parametrize("spec", ["bf16", "fp8", "nvfp4", "int4:r=0", "int4:r=0,keys=token,v=nvfp4"])
def test_a_score_bias_adds_before_scaling_on_every_path(spec, isa):
    """Outlier channels held apart reach the kernel as a per-token score bias; each decode path adds
    it as the reference does, dense and sparse."""
    view, (tk, tv), q = _view(spec, (1, 9, 3, 64), seed=4)
    total = view.tokens + tk.shape[-2]
    bias = torch.randn(1, 9, total, generator=torch.Generator().manual_seed(4))
    ref = decode_attention(q, view, tk, tv, 0.1, bias=bias, fused=False)
    torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, bias=bias), ref, rtol=1e-4, atol=1e-5)
    idx = torch.stack([torch.randperm(total, generator=torch.Generator().manual_seed(h))[:25].sort().values
                       for h in range(3)])[None]
    ref = decode_attention(q, view, tk, tv, 0.1, idx=idx, bias=bias, fused=False)
    torch.testing.assert_close(decode_attention(q, view, tk, tv, 0.1, idx=idx, bias=bias), ref,
                               rtol=1e-4, atol=1e-5)
