"""`kvstrata serve-batch-bench`: batched vs unbatched `kvstrata serve` under concurrent streams
(`kvstrata_lab.serve_bench.batching`; flags' defaults from `BatchBenchConfig`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from kvstrata.cli.inputs import BIG, SEED, field_default, int_in, nonempty
from kvstrata.settings import DTYPES
from kvstrata_lab.serve_bench.config import BatchBenchConfig


def _counts(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1 or max(out) > 256:
        raise argparse.ArgumentTypeError(f"expected comma-separated stream counts in [1, 256], got {text!r}")
    return out


def register(sub) -> None:
    def default(name: str):
        return field_default(BatchBenchConfig, name)

    s = sub.add_parser(
        "serve-batch-bench",
        help="kvstrata serve batched vs unbatched: aggregate tokens/s, "
        "TPOT, a late arrival's TTFT, sequences held under a KV budget",
    )
    s.add_argument("--model", default=default("model"), type=nonempty)
    s.add_argument(
        "--methods",
        default=",".join(default("methods")),
        type=nonempty,
        help="comma-separated method specs (bf16 among them for the budget comparison)",
    )
    s.add_argument(
        "--streams", type=_counts, default=default("streams"), help="concurrent streams, e.g. 1,4,8,16"
    )
    s.add_argument(
        "--requests",
        type=int_in(1, 10_000),
        default=default("requests"),
        help="requests per stream at each level",
    )
    s.add_argument(
        "--level-requests",
        type=int_in(1, 100_000),
        default=default("level_requests"),
        help="requests per level at least, however few its streams",
    )
    s.add_argument("--prompt-tokens", type=int_in(1, BIG), default=default("prompt_tokens"),
                   help="tokens of each stream's prompt")
    s.add_argument("--max-tokens", type=int_in(2, BIG), default=default("max_tokens"),
                   help="tokens each request generates")
    s.add_argument("--probe-tokens", type=int_in(1, BIG), default=default("probe_tokens"),
                   help="the late arrival's prompt, timed idle and while streams decode")
    s.add_argument(
        "--budget-sequences",
        type=int_in(1, 1024),
        default=default("budget_sequences"),
        help="the KV budget holds this many bf16 sequences at their longest",
    )
    s.add_argument("--budget-streams", type=int_in(1, 256), default=default("budget_streams"),
                   help="streams offered under the KV budget")
    s.add_argument("--peer", choices=["llama-server"], default=None,
                   help="also run the levels against llama.cpp's llama-server (-np = streams) on the GGUF "
                        "the model is converted from, in the same run (built once: make llamacpp)")
    s.add_argument("--dtype", choices=DTYPES, default=default("dtype"),
                   help="our servers' weights and activations (results go to <model>-<dtype> unless float32)")
    s.add_argument("--seed", type=SEED, default=default("seed"))
    s.add_argument("--out", default=default("out"), type=nonempty)
    s.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import check_context, split_methods, writable_dir
    from kvstrata_lab.serve_bench.batching import run as bench

    writable_dir(args.out, "--out")
    check_context(
        args.model,
        max(args.prompt_tokens, args.probe_tokens) + 2 * args.max_tokens + 64,
        "--prompt-tokens" if args.prompt_tokens >= args.probe_tokens else "--probe-tokens",
    )
    cfg = BatchBenchConfig(
        model=args.model,
        methods=tuple(split_methods(args.methods)),
        streams=args.streams,
        requests=args.requests,
        level_requests=args.level_requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        probe_tokens=args.probe_tokens,
        budget_sequences=args.budget_sequences,
        budget_streams=args.budget_streams,
        peer=args.peer or "",
        seed=args.seed,
        out=args.out,
        dtype=args.dtype,
    )
    result = bench(cfg, command="kvstrata " + shlex.join(sys.argv[1:]))
    print(json.dumps(result["summary"], indent=1))
    print(f"results in {args.out}")
    return 0
