"""`kvstrata step-bench`: what one batched decode step costs, in process (no HTTP, no sampling).

The server's worker runs each step as one `batched_forward` over a row per running request; this
times that call alone at 1 and N rows per method (each row its own cache, prefilled with
`--prompt-tokens` of random ids), in interleaved rounds whose medians are kept, and profiles the
N-row step (cProfile, functions by own time), so what a row adds can be read off: the model's
linear layers at N tokens against 1, the cache append, the encode, the kernel arguments.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvstrata.codecs import nvfp4
from kvstrata.hf import CompressedCache, linear
from kvstrata.hf.batch import Row, batched_forward
from kvstrata.models.loader import load


def _caches(model, method: str, rows: int, prompt: int, gen: torch.Generator) -> list[CompressedCache]:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    out = []
    for _ in range(rows):
        cache = CompressedCache(model.config, method)
        ids = torch.randint(3, vocab, (prompt,), generator=gen).tolist()
        batched_forward(model, [Row(cache=cache, ids=ids)])
        out.append(cache)
    return out


def _step(model, caches: list, gen: torch.Generator, vocab: int) -> None:
    ids = torch.randint(3, vocab, (len(caches),), generator=gen).tolist()
    batched_forward(model, [Row(cache=c, ids=[t]) for c, t in zip(caches, ids)])


def measure(model, method: str, rows: int, prompt: int, rounds: int, steps: int, seed: int = 0) -> dict:
    """ms per step at 1 and `rows` rows (medians over `rounds` interleaved rounds of `steps` steps),
    the tokens/s ratio, and the `rows`-row step's profile (top functions by own time)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    caches = _caches(model, method, rows, prompt, gen)
    times: dict[int, list[float]] = {1: [], rows: []}
    for _ in range(rounds):
        for k in times:
            _step(model, caches[:k], gen, vocab)  # warm: the first step after a switch is not timed
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, caches[:k], gen, vocab)
            times[k].append((time.perf_counter() - start) / steps * 1e3)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _step(model, caches, gen, vocab)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    one, many = statistics.median(times[1]), statistics.median(times[rows])
    return {"method": method, "rows": rows, "prompt_tokens": prompt, "ms_1": one, f"ms_{rows}": many,
            "tokens_per_s_ratio": rows * one / many, "rounds": {str(k): v for k, v in times.items()},
            "profile": text.getvalue()}


@contextlib.contextmanager
def _python_encode():
    saved = nvfp4._native
    nvfp4._native = lambda x: None
    try:
        yield
    finally:
        nvfp4._native = saved


def run(model_name: str, methods: list[str], rows: int, prompt: int, rounds: int, steps: int, out: Path,
        dtype: str = "float32", python_encode: bool = False, torch_linear: bool = False) -> Path:
    """Every method, and with `python_encode` each NVFP4 one again with the PyTorch encode instead of
    the C++ one (the same codes, the cost apart), with `torch_linear` each one again with torch's
    linear layers instead of the kernel's (`kvstrata.hf.linear`), into `<out>/<model>.{json,md}`."""
    model, _ = load(model_name, dtype)
    out.mkdir(parents=True, exist_ok=True)
    cells = [(m, "", contextlib.nullcontext) for m in methods]
    if python_encode:
        cells += [(m, " (PyTorch encode)", _python_encode) for m in methods
                  if m.split(":")[0].split("+")[0] == "nvfp4"]
    if torch_linear:
        cells += [(m, " (torch linear)", lambda: linear.torch_linears(model)) for m in methods]
    results = []
    for method, label, scope in tqdm(cells, desc="step-bench", unit="cell"):
        with scope():
            got = measure(model, method, rows, prompt, rounds, steps)
        results.append(dict(got, method=method + label, model=model_name, dtype=dtype,
                            threads=torch.get_num_threads()))
    stem = out / model_name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# step-bench: {model_name} ({dtype}, {torch.get_num_threads()} threads)\n",
             f"One `batched_forward` decode step, caches of {prompt} tokens; medians of {rounds} "
             f"interleaved rounds of {steps} steps.\n",
             f"| method | 1 row (ms) | {rows} rows (ms) | tokens/s, {rows} rows ÷ 1 |", "|---|---|---|---|"]
    lines += [f"| `{r['method']}` | {r['ms_1']:.1f} | {r[f'ms_{rows}']:.1f} | "
              f"{r['tokens_per_s_ratio']:.2f}× |" for r in results]
    for r in results:
        lines += ["", f"## `{r['method']}`: the {rows}-row step's profile", "", "```", r["profile"].strip(),
                  "```"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".md")
