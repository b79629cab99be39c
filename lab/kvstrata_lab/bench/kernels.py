"""`kvstrata kernels-bench`: decode attention over caches of 2k … 64k tokens, every codec's fused
kernel against SDPA over the same cache in bf16 and float32, and the machine's copy bandwidth on
buffers of the same size, all in one run; NVFP4 and MXFP4 also with keys scored in integers
(`+int8q`, KVSTRATA_KERNEL_SCORES=int8) where the build can. Rows go to `OUT/kernels.jsonl`, a plot
beside it."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvstrata.codecs.transform import Fitted
from kvstrata.hf.segments import encode_segment
from kvstrata.methods import parse_method
from kvstrata.read.decode import EncodedView, decode_attention, kernel_args, triton_runs
from kvstrata.read.kernels import cpu
from kvstrata_lab.bench.results import ReportInput, read_jsonl

# (query heads, KV heads, head_dim) of the real models
SHAPES = {"smollm2-135m": (9, 3, 64), "gemma3-270m": (4, 1, 256), "qwen2.5-coder-0.5b": (14, 2, 64),
          "qwen2.5-coder-1.5b": (12, 2, 128)}
CODECS = ("bf16", "fp8", "nvfp4", "mxfp4", "int4:r=0", "int2:r=0")
# codecs whose keys the kernel can also score in integers (KVSTRATA_KERNEL_SCORES=int8): a row each
INT8_CODECS = ("nvfp4", "mxfp4")
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)


def _encoded(spec: str, k: torch.Tensor, v: torch.Tensor):
    """`k, v` encoded with `spec`'s recipe (its transforms fitted on `k`), and the view attention reads."""
    rec = parse_method(spec).full
    fitted = Fitted.fit(rec.transforms, k)
    seg = encode_segment(rec, k, v, fitted)
    return rec, seg, EncodedView(key_channel=rec.key_axis == "channel", runs=[(seg.keys, seg.values, 0)],
                                 fitted=fitted)


def _time(fn, repeats: int, cuda: bool = False) -> float:
    """Median wall seconds of `fn()` over `repeats` calls (after one warm-up; GPU work synchronised)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of `dst.copy_(src)` for buffers of `nbytes` (reads + writes counted once: the
    bytes moved, as a kernel that reads `nbytes` once moves them)."""
    src = torch.ones(max(nbytes, 4096), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return src.numel() / _time(lambda: dst.copy_(src), repeats)


def measure(shape_name: str, n: int, repeats: int, seed: int = 0) -> list[dict]:
    hq, hk, d = SHAPES[shape_name]
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, hk, n, d, generator=g), torch.randn(1, hk, n, d, generator=g)
    q = torch.randn(1, hq, 1, d, generator=g)
    tk, tv = torch.randn(1, hk, 1, d, generator=g), torch.randn(1, hk, 1, d, generator=g)
    scale = d**-0.5
    kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
    base = {"shape": shape_name, "tokens": n, "q_heads": hq, "kv_heads": hk, "head_dim": d,
            "threads": torch.get_num_threads()}
    sdpa_bf16 = _time(lambda: F.scaled_dot_product_attention(
        qb, kb, vb, scale=scale, enable_gqa=True), repeats)
    sdpa_f32 = _time(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), repeats)
    rows = [dict(base, codec="sdpa-bf16", seconds=sdpa_bf16, bytes=2 * kb.numel() * 2),
            dict(base, codec="sdpa-f32", seconds=sdpa_f32, bytes=2 * k.numel() * 4)]
    module = cpu.load()
    int8 = module is not None and module.int8_scores()
    for spec, scores in [(s, "float") for s in CODECS] + [(s, "int8") for s in INT8_CODECS if int8]:
        rec, seg, view = _encoded(spec, k, v)
        held = sum(t.numel() * t.element_size() for t in seg.parts())
        with mock.patch.dict(os.environ, {"KVSTRATA_KERNEL_SCORES": scores}):
            if module is not None:
                args = kernel_args(view, tk, tv)
                qq, empty = q[:, :, 0].contiguous(), torch.empty(0, dtype=torch.int64)
                no_bias = torch.empty(0)
                kernel = _time(lambda: module.decode_attention(qq, *args, scale, 0.0, empty, no_bias),
                               repeats)
            else:
                kernel = None
            op = _time(lambda: decode_attention(q, view, tk, tv, scale), repeats)
        bw = copy_bandwidth(held, repeats)
        name = rec.codec.name + ("+int8q" if scores == "int8" else "")
        rows.append(dict(base, codec=name, spec=spec, scores=scores, seconds=op, kernel_seconds=kernel,
                         bytes=held, copy_bytes_per_s=bw, effective_bytes_per_s=held / (kernel or op),
                         vs_sdpa_bf16=op / sdpa_bf16, vs_sdpa_f32=op / sdpa_f32))
    return rows


def measure_cuda(shape_name: str, n: int, repeats: int, seed: int = 0) -> list[dict]:
    """The Triton kernels on the GPU against SDPA over the same cache in bf16, and the card's copy
    bandwidth on buffers of the same size."""
    from kvstrata.read.kernels import triton_decode  # optional dependency: triton

    hq, hk, d = SHAPES[shape_name]
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, hk, n, d, generator=g), torch.randn(1, hk, n, d, generator=g)
    q, tk, tv = (torch.randn(1, h, 1, d, generator=g).cuda() for h in (hq, hk, hk))
    scale = d**-0.5
    kb, vb = k.cuda().bfloat16(), v.cuda().bfloat16()
    base = {"shape": shape_name, "tokens": n, "q_heads": hq, "kv_heads": hk, "head_dim": d, "device": "cuda",
            "gpu": torch.cuda.get_device_name()}
    sdpa = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), kb, vb, scale=scale,
                                                                          enable_gqa=True), repeats, True)
    rows = [dict(base, codec="sdpa-bf16", seconds=sdpa, bytes=2 * kb.numel() * 2)]
    for spec in CODECS:
        rec, seg, view = _encoded(spec, k.cuda(), v.cuda())
        runs = triton_runs(view)
        held = sum(t.numel() * t.element_size() for t in seg.parts())
        op = _time(lambda: triton_decode.attend(q, runs, tk, tv, scale), repeats, True)
        src = torch.ones(held, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        bw = held / _time(lambda: dst.copy_(src), repeats, True)
        rows.append(dict(base, codec=rec.codec.name, spec=spec, seconds=op, bytes=held, copy_bytes_per_s=bw,
                         effective_bytes_per_s=held / op, vs_sdpa_bf16=op / sdpa, vs_sdpa_f32=None))
    return rows


def run(out: Path, lengths=LENGTHS, shapes=tuple(SHAPES), repeats: int = 9) -> Path:
    """CPU rows always; GPU rows (Triton) too when a CUDA device is present."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kernels.jsonl"
    rows = []
    for shape in shapes:
        for n in tqdm(lengths, desc=f"kernels-bench {shape}", unit="length"):
            rows += measure(shape, n, repeats)
            if torch.cuda.is_available():
                rows += measure_cuda(shape, n, repeats)
    meta = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "kernel": "cpu" if cpu.load() is not None else "reference"}
    path.write_text("".join(json.dumps(dict(r, **{"meta": meta})) + "\n" for r in rows))
    plot(rows, out)
    return path


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape]
        for codec in dict.fromkeys(r["codec"] for r in rs):
            pts = [(r["tokens"], r["seconds"] * 1e3) for r in rs if r["codec"] == codec]
            style = "--" if codec.startswith("sdpa") else "-"
            ax.plot(*zip(*pts), style, marker="o", label=codec)
        ax.set(xscale="log", yscale="log", xlabel="cached tokens", ylabel="ms per decode step (one layer)",
               title=f"{shape} heads: decode attention")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "kernels.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_section(given: ReportInput) -> str:
    rows = read_jsonl(given.out / "kernels" / "kernels.jsonl")
    if not rows:
        return ""
    lines = ["## Decode-attention kernels\n",
             "`kvstrata kernels-bench`: one layer's decode attention (one query token) over a cache of n "
             "tokens, each codec's fused kernel against SDPA over the same cache held in bf16 and in "
             "float32; effective bandwidth = bytes of codes + scales read ÷ time, against a copy of a "
             "buffer of the same size measured in the same run.\n"]
    if (given.out / "kernels" / "kernels.png").exists():
        lines.append("![decode-attention kernels](kernels/kernels.png)\n")
    if not any(r.get("device") == "cuda" for r in rows):
        lines.append("No GPU was available for this run: the Triton kernels were checked for correctness "
                     "only (in Triton's interpreter, by the tests), not timed.\n")
    for shape, device in dict.fromkeys((r["shape"], r.get("device", "cpu")) for r in rows):
        rs = [r for r in rows if r["shape"] == shape and r.get("device", "cpu") == device]
        lines += [f"### {shape} heads, {device}\n", "| tokens | codec | ms | × SDPA bf16 | × SDPA f32 | GB/s "
                                                    "| copy GB/s |",
                  "|---|---|---|---|---|---|---|"]
        for r in rs:
            if r["codec"].startswith("sdpa"):
                lines.append(f"| {r['tokens']:,} | {r['codec']} | {r['seconds'] * 1e3:.3f} | | | | |")
            else:
                lines.append(f"| {r['tokens']:,} | {r['codec']} | {r['seconds'] * 1e3:.3f} | "
                             f"{r['vs_sdpa_bf16']:.2f} | "
                             f"{'–' if r['vs_sdpa_f32'] is None else format(r['vs_sdpa_f32'], '.2f')} | "
                             f"{r['effective_bytes_per_s'] / 1e9:.2f} | {r['copy_bytes_per_s'] / 1e9:.2f} |")
        lines.append("")
    return "\n".join(lines)
