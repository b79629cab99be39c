"""`kvstrata memory-bench`: the memory a user sees when generating from a long prompt.

Each run is `kvstrata generate` in its own process; its peak RSS minus the peak RSS of the same
command on a 5-token prompt is what the long context cost, compared with the bytes the cache holds
(target: at most those bytes + 256 MiB, i.e. the prefill's transient full-precision K/V and
attention workspace stay bounded). Runs with and without chunked prefill show what chunking buys.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvstrata.models.loader import load_tokenizer
from kvstrata_lab.bench.corpus import prose_and_continuation
from kvstrata_lab.bench.results import ReportInput, read_jsonl

SLACK_MB = 256.0


def _generate(model: str, method: str, prompt_file: Path, chunk: int, new_tokens: int) -> dict:
    cmd = [sys.executable, "-c", "import sys; from kvstrata.cli import main; sys.exit(main())", "generate",
           "--model", model, "--method", method, "--prompt-file", str(prompt_file), "--max-new-tokens",
           str(new_tokens), "--prefill-chunk", str(chunk), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"generate --method {method} failed: "
                           f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(
    model: str, tokens: int, methods: list[str], chunks: list[int], out: Path, new_tokens: int = 8
) -> Path:
    """One JSON row per (method, chunk) in `out/memory.jsonl` (rewritten); returns its path."""
    tok = load_tokenizer(model)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        long_file, short_file = Path(d) / "long.txt", Path(d) / "short.txt"
        long_file.write_text(prose_and_continuation(tok, tokens, 1)[0])
        short_file.write_text(prose_and_continuation(tok, 5, 1)[0])
        rows = []
        for method in tqdm(methods, desc="memory-bench", unit="method"):
            base = _generate(model, method, short_file, 0, new_tokens)
            for chunk in chunks:
                g = _generate(model, method, long_file, chunk, new_tokens)
                above = g["peak_rss_mb"] - base["peak_rss_mb"]
                held = g["kv_bytes"] / 2**20
                rows.append(
                    {
                        "model": model, "method": method, "prefill_chunk": chunk,
                        "context_tokens": g["context_tokens"], "peak_rss_mb": g["peak_rss_mb"],
                        "baseline_rss_mb": base["peak_rss_mb"], "above_baseline_mb": above, "kv_mb": held,
                        "within_target": above <= held + SLACK_MB,
                    }
                )
    path = out / "memory.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def report_section(given: ReportInput) -> str:
    rows = read_jsonl(given.out / "kernels" / "memory.jsonl")
    if not rows:
        return ""
    lines = [
        "## Memory while generating\n",
        f"`kvstrata generate` in its own process on a {rows[0]['context_tokens']:,}-token prompt "
        f"({rows[0]['model']}): peak RSS above the same command on a 5-token prompt, against the bytes the "
        f"cache holds (target: ≤ KV + {SLACK_MB:.0f} MiB). `chunk` = prompt tokens per prefill pass (0: one "
        "pass).\n",
        "| method | chunk | KV held (MiB) | peak above baseline (MiB) | within target |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['method']}` | {r['prefill_chunk']} | {r['kv_mb']:.0f} | {r['above_baseline_mb']:.0f} | "
            f"{'yes' if r['within_target'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
