"""`kvstrata scaling-bench`: how decode time and memory grow with the context, per method.

For each context length a natural-prose prompt is prefilled once (chunked) in a process of its own
and its K/V saved per layer (safetensors). Each (length, method) point then runs in a process of
its own: the model loaded and a 5-token step run (the baseline), the saved K/V loaded one layer at a
time into the method's cache (`dynamic`: transformers' DynamicCache, `static`: its StaticCache sized
to the context + the new tokens, both attending as the model does; any other spec: kvstrata's
cache), `new` greedy decode steps timed (the first apart), then the peak RSS since the baseline (the
kernel's peak counter reset there: loading the model peaks higher than a context costs) above it,
and the bytes the cache holds. The allocator first reuses the ~25 MB loading the model left free
(resident), so a point whose cache and transients stay below that shows ~0 above the baseline.
Rows go to `OUT/scaling.jsonl`; `OUT/scaling.png` plots both.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.attention import stock_attention
from kvstrata.hf.run import _malloc_trim, forward, peak_rss_mb, prefill_chunked
from kvstrata.hf.topk_attention import reading
from kvstrata.methods import parse_method
from kvstrata.models.loader import load
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.config import STOCK
from kvstrata_lab.bench.corpus import natural_ids
from kvstrata_lab.bench.results import ReportInput, read_jsonl

METHODS = ("dynamic", "static", "bf16", "fp8", "nvfp4", "int4:r=32",
           "topk:k=512,schedule=F1,indexer=lowrank,rank=16")
LENGTHS = {"gemma3-270m": (2048, 4096, 8192, 16384, 32000), "smollm2-135m": (2048, 4096, 8000)}
CHUNK = 512


def save_prefill(model_name: str, tokens: int, path: Path) -> None:
    """Prefill `tokens` of natural prose and save every layer's K/V, what each has seen, and the
    greedy next token."""
    model, tok = load(model_name)
    ids = torch.tensor([natural_ids(tok, tokens)])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        prefill_chunked(model, cache, ids[:, :-1], CHUNK)
        logits = forward(model, ids[:, -1:], cache)
    tensors, seen = {}, []
    for i, layer in enumerate(cache.layers):
        tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
        seen.append(int(getattr(layer, "cumulative_length", layer.keys.shape[-2])))
    meta = {"model": model_name, "tokens": str(tokens), "seen": json.dumps(seen),
            "next": str(int(logits[0, -1].argmax()))}
    save_file(tensors, str(path), metadata=meta)


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _layers(path: Path):
    """The saved prefill's layers, one at a time: (k, v, seen). Read with plain file reads, not a
    memory map, so a layer's bytes leave the process once it is in the cache (a mapped file's pages
    would count in RSS for as long as it is open)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        seen = json.loads(header["__metadata__"]["seen"])

        def tensor(name: str) -> torch.Tensor:
            entry = header[name]
            start, stop = entry["data_offsets"]
            f.seek(8 + size + start)
            data = bytearray(f.read(stop - start))
            return torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])

        for i, s in enumerate(seen):
            yield tensor(f"k{i}"), tensor(f"v{i}"), s


def _cache(model, method: str, path: Path, tokens: int, new: int):
    """(cache holding the saved prefill, the context its decode steps run in, bytes it holds)."""
    if method in STOCK:
        cache = (DynamicCache(config=model.config) if method == "dynamic"
                 else StaticCache(config=model.config, max_cache_len=tokens + new + 1))
        fill = protocol.fill_dynamic if method == "dynamic" else protocol.fill_static
        for layer, (k, v, seen) in zip(cache.layers, _layers(path)):
            fill(layer, k, v, seen)
        return cache, stock_attention(model.config), lambda: protocol.dynamic_bytes(cache)
    spec = parse_method(method)
    cache = CompressedCache(model.config, spec)
    for layer, (k, v, seen) in zip(cache.layers, _layers(path)):
        layer.load_prefill(k, v, seen)  # one layer's full-precision K/V alive at a time
    return cache, reading(model, cache, spec), lambda: cache.nbytes()["total"]


def _status_mb(key: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> float:
    """Reset this process's peak RSS to its current RSS (Linux: clear_refs 5); returns it, MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def point(model_name: str, method: str, path: Path, new: int) -> dict:
    """One (length, method) point, in this process (see the module's docstring)."""
    model, _ = load(model_name)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tokens, nxt = int(meta["tokens"]), torch.tensor([[int(meta["next"])]])
    with torch.inference_mode():
        stock = method in STOCK  # the baseline: a 5-token step through the same attention
        small = DynamicCache(config=model.config) if stock else CompressedCache(model.config, "bf16")
        with stock_attention(model.config) if stock else contextlib.nullcontext():
            forward(model, torch.arange(5)[None] + 100, small)
        del small
        gc.collect()
        _malloc_trim()
        base = _reset_peak()  # loading the model peaked higher than a context costs; start afresh
        cache, ctx, held = _cache(model, method, path, tokens, new)
        gc.collect()
        _malloc_trim()
        times, greedy = [], []
        with ctx:
            for _ in range(new):
                t0 = time.perf_counter()
                nxt = forward(model, nxt, cache)[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t0)
                greedy.append(int(nxt))
        peak = _status_mb("VmHWM")
    steps = times[1:] or times
    return {"model": model_name, "method": method, "tokens": tokens, "new_tokens": new,
            "decode_s_per_token": sum(steps) / len(steps), "first_step_s": times[0], "kv_mb": held() / 2**20,
            "baseline_rss_mb": base, "peak_rss_mb": peak, "above_baseline_mb": peak - base,
            "process_peak_rss_mb": peak_rss_mb(),
            "threads": torch.get_num_threads(), "greedy": greedy}


def _saved(path: Path, model_name: str, tokens: int) -> bool:
    """Whether `path` is a readable prefill of `tokens` tokens saved by `save_prefill` for this model."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - missing, cut short or not ours: prefill again
        return False
    return meta.get("model") == model_name and meta.get("tokens") == str(tokens)


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "kvstrata_lab.bench.scaling", *args]
    # large buffers mapped apart, so one freed is gone from RSS (not kept in the heap for reuse)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"scaling-bench {args[0]} {' '.join(args[1:3])} failed: "
                           f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def run(model_name: str, lengths: tuple[int, ...], methods: tuple[str, ...], out: Path, new: int = 16,
        work: Path | None = None) -> Path:
    """Every point in its own process; rows appended to `out/scaling.jsonl` as they finish (a point
    already there is skipped), then the plot. Prefills are kept in `work` (default
    `$KVSTRATA_CACHE/scaling`: hundreds of MB at 32k, never beside the results)."""
    out.mkdir(parents=True, exist_ok=True)
    work = work or Path(os.environ.get("KVSTRATA_CACHE", Path.home() / ".cache" / "kvstrata")) / "scaling"
    work.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.jsonl"
    done = {(r["model"], r["tokens"], r["method"]) for r in read_jsonl(path)}
    todo = [(n, m) for n in lengths for m in methods if (model_name, n, m) not in done]
    with path.open("a") as f:
        for n, m in tqdm(todo, desc=f"scaling-bench {model_name}", unit="point"):
            saved = work / f"{model_name}-{n}.safetensors"
            if not _saved(saved, model_name, n):
                _child(["prefill", model_name, str(n), str(saved)])
            row = _child(["point", model_name, m, str(saved), str(new)])
            f.write(json.dumps(row) + "\n")
            f.flush()
    plot(read_jsonl(path), out)
    return path


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib  # optional dependency (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the bench extra)

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    for (ax_t, ax_m), model in zip(axes, models):
        rs = [r for r in rows if r["model"] == model]
        for i, method in enumerate(dict.fromkeys(r["method"] for r in rs)):
            pts = sorted((r["tokens"], r) for r in rs if r["method"] == method)
            xs = [n for n, _ in pts]
            style = "--" if method in STOCK else "-"
            colour = f"C{i}"
            ax_t.plot(xs, [r["decode_s_per_token"] * 1e3 for _, r in pts], style, marker="o", color=colour,
                      label=method)
            ax_m.plot(xs, [r["above_baseline_mb"] for _, r in pts], style, marker="o", color=colour,
                      label=f"{method} (peak RSS above baseline)")
            ax_m.plot(xs, [r["kv_mb"] for _, r in pts], ":", color=colour, alpha=0.6)
        ax_t.set(xscale="log", xlabel="context tokens", ylabel="ms per decode token",
                 title=f"{model}: decode time")
        ax_m.set(xscale="log", xlabel="context tokens", ylabel="MiB",
                 title=f"{model}: memory (solid/dashed: peak RSS above baseline; dotted: KV held)")
        for ax in (ax_t, ax_m):
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    path = out / "scaling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_section(given: ReportInput) -> str:
    rows = read_jsonl(given.out / "scaling" / "scaling.jsonl")
    if not rows:
        return ""
    lines = ["## Scaling with the context\n",
             "`kvstrata scaling-bench`: each point in its own process; decode ms per token (after the "
             "first step) and peak RSS above a 5-token baseline (MiB), with the KV held.\n",
             "| model | tokens | method | ms/token | × static | peak above baseline | KV held |",
             "|---|---|---|---|---|---|---|"]
    static = {(r["model"], r["tokens"]): r["decode_s_per_token"] for r in rows if r["method"] == "static"}
    for r in rows:
        ref = static.get((r["model"], r["tokens"]))
        ratio = f"{r['decode_s_per_token'] / ref:.2f}" if ref else "–"
        lines.append(f"| {r['model']} | {r['tokens']:,} | `{r['method']}` | "
                     f"{r['decode_s_per_token'] * 1e3:.1f} | {ratio} | {r['above_baseline_mb']:.0f} | "
                     f"{r['kv_mb']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the per-process steps `run` spawns
    what = sys.argv[1]
    if what == "prefill":
        save_prefill(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    else:
        print(json.dumps(point(sys.argv[2], sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]))))
