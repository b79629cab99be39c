"""`make gpu-proof`: the Triton decode kernels on a CUDA device, in one short script.

It checks every codec's kernel against decode-then-attend (computed on the CPU: dense, softcapped,
sparse, and a batched step's rows in one varlen launch against each row's own call, exactly), then
times decode attention against SDPA over the same cache in bf16 (`kernels-bench`'s CUDA rows) and
writes `OUT/gpu_proof.json`. Without a GPU it runs the same checks on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1`, small sizes, no timing): that is its test. Exit 1 when a check fails.

    python -m kvstrata_lab.bench.gpu_proof --out docs/results/gpu-proof   # < 10 min on one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton reads this when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstrata.codecs.qtensor import QTensor  # noqa: E402
from kvstrata.hf.segments import encode_segment  # noqa: E402
from kvstrata.methods import parse_method  # noqa: E402
from kvstrata.read.decode import EncodedView, decode_attention, triton_runs  # noqa: E402
from kvstrata_lab.bench.kernels import measure_cuda  # noqa: E402

SPECS = ("bf16", "fp8", "nvfp4", "mxfp4", "int4:r=0", "int2:r=0", "int3:r=0", "int4:r=0,keys=token",
         "nvfp4:v=int2", "fp8:v=mxfp4")
SHAPES = {"smollm2-135m": (1, 9, 3, 64), "gemma3-270m": (1, 4, 1, 256), "ragged": (2, 4, 2, 48)}
TOLERANCE = 1e-4  # max |Triton - reference| / (1 + max |reference|)


def _moved(q: QTensor, device: str) -> QTensor:
    parts = {k: v.to(device) for k, v in q.parts.items()}
    return QTensor(codec=q.codec, shape=q.shape, dtype=q.dtype, parts=parts)


def _case(spec: str, shape: tuple, tokens: int, seed: int):
    """Two encoded runs (the first hiding 5 tokens), a 3-token full-precision tail, a query and 20
    sparse positions per KV head, on the CPU."""
    b, hq, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    rec = parse_method(spec).full
    k, v = torch.randn(b, hk, tokens, d, generator=g) * 2, torch.randn(b, hk, tokens, d, generator=g)
    half = tokens // 2
    s1 = encode_segment(rec, k[..., :half, :], v[..., :half, :])
    s2 = encode_segment(rec, k[..., half:, :], v[..., half:, :])
    view = EncodedView(key_channel=rec.key_axis == "channel",
                       runs=[(s1.keys, s1.values, 5), (s2.keys, s2.values, 0)])
    tk, tv = torch.randn(b, hk, 3, d, generator=g), torch.randn(b, hk, 3, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    total = view.tokens + 3
    idx = torch.stack([torch.randperm(total, generator=g)[:20].sort().values for _ in range(b * hk)])
    return view, tk, tv, q, idx.reshape(b, hk, 20)


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.cpu() - ref).abs().max() / (1 + ref.abs().max()))


def check(device: str, specs=SPECS, shapes=SHAPES, tokens: int = 192) -> list[dict]:
    """One row per (spec, shape, mode): the kernel's relative error against the CPU reference."""
    from kvstrata.read.kernels import triton_decode, triton_varlen  # optional dependency: triton

    rows = []
    for spec in specs:
        for name, shape in shapes.items():
            view, tk, tv, q, idx = _case(spec, shape, tokens, seed=len(rows))
            dev = EncodedView(key_channel=view.key_channel,
                              runs=[(_moved(k, device), _moved(v, device), s) for k, v, s in view.runs])
            runs, (dq, dk, dv, di) = triton_runs(dev), (t.to(device) for t in (q, tk, tv, idx))
            for mode, kw, kernel_kw in (("dense", {}, {}), ("softcap", {"softcap": 4.0}, {"softcap": 4.0}),
                                        ("sparse", {"idx": idx}, {"idx": di})):
                ref = decode_attention(q, view, tk, tv, 0.125, fused=False, **kw)
                got = triton_decode.attend(dq, runs, dk, dv, 0.125, **kernel_kw)
                rows.append({"spec": spec, "shape": name, "mode": mode, "error": _error(got, ref)})
            if shape[0] != 1:  # varlen rows are sequences of their own (a batch of one each)
                continue
            # a batched step: this row and a shorter copy of it in one launch, each equal to its own call
            short = (dq, runs, dk[..., :1, :], dv[..., :1, :])
            pairs = ([full, part] for full, part in zip((dq, runs, dk, dv), short))
            got = triton_varlen.attend_rows(*pairs, 0.125)
            own = [triton_decode.attend(dq, runs, dk, dv, 0.125), triton_decode.attend(*short, 0.125)]
            exact = all(torch.equal(a, b) for a, b in zip(got, own))
            rows.append({"spec": spec, "shape": name, "mode": "varlen", "error": 0.0 if exact else math.inf})
    for r in rows:
        r["ok"] = r["error"] <= TOLERANCE
    return rows


def timings(lengths=(4096, 16384, 65536), repeats: int = 20) -> list[dict]:
    """`kernels-bench`'s CUDA rows: every codec's Triton kernel against SDPA over a bf16 cache."""
    shapes = ("smollm2-135m", "gemma3-270m")
    return [row for shape in shapes for n in lengths for row in measure_cuda(shape, n, repeats)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/gpu-proof",
                    help="where gpu_proof.json goes (default: %(default)s)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA device: the checks run on the CPU under Triton's interpreter (no timing)")
    t0 = time.time()
    rows = check("cuda" if cuda else "cpu")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} checks within {TOLERANCE:g} ({time.time() - t0:.0f} s)")
    for r in bad:
        print(f"  FAILED {r['spec']} {r['shape']} {r['mode']}: error {r['error']:.2e}")
    times = timings() if cuda else []
    for r in times:
        if r["codec"] != "sdpa-bf16":
            share = r["effective_bytes_per_s"] / r["copy_bytes_per_s"]
            print(f"{r['shape']} {r['tokens']:>6} {r['spec']:<10} {r['seconds'] * 1e3:7.3f} ms  "
                  f"x SDPA bf16 {r['vs_sdpa_bf16']:.2f}  {share:.0%} of copy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)"
    report = {"device": device, "checks": rows, "timings": times}
    (out / "gpu_proof.json").write_text(json.dumps(report, indent=1))
    print(f"results: {out / 'gpu_proof.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
