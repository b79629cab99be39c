"""`kvstrata serve-bench`: the server under agent load (flags' defaults from `ServeBenchConfig`)."""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.cli.inputs import BIG, SEED, field_default, float_in, int_in, nonempty
from kvstrata_lab.serve_bench.config import SERVE_PEERS, ServeBenchConfig

DAY_S = 86400.0


def register(sub) -> None:
    def default(name: str):
        return field_default(ServeBenchConfig, name)

    b = sub.add_parser(
        "serve-bench",
        help="load + fault harness: N openai clients, multi-turn agent sessions, store on vs off (and a peer "
             "server)",
    )
    b.add_argument("--model", default=default("model"), type=nonempty)
    b.add_argument("--method", default=default("method"), type=nonempty)
    b.add_argument("--clients", type=int_in(1, 1024), default=default("clients"),
                   help="concurrent openai clients")
    b.add_argument("--turns", type=int_in(1, 10_000), default=default("turns"), help="turns per conversation")
    b.add_argument("--conversations", type=int_in(1, 10_000), default=default("conversations"),
                   help="conversations per client")
    b.add_argument("--context", type=int_in(1, BIG), default=default("context"),
                   help="tokens of each conversation's opening document")
    b.add_argument("--tool-tokens", type=int_in(0, BIG), default=default("tool_tokens"),
                   help="tokens of each tool-result turn")
    b.add_argument("--max-tokens", type=int_in(1, BIG), default=default("max_tokens"),
                   help="tokens generated per turn")
    b.add_argument("--duration", type=float_in(1, 7 * DAY_S), default=default("duration_s"),
                   help="seconds each phase may run at most")
    b.add_argument("--probe-tokens", type=int_in(0, BIG), default=default("probe_tokens"),
                   help="single-client cold / warm / replay probe at this prompt length (0: skip)")
    b.add_argument("--probe-swa-ttl", type=float_in(1, 3600), default=default("probe_swa_ttl_s"),
                   help="the probe server's SWA TTL, seconds: warm turns come within it, the replay turn "
                        "after it")
    b.add_argument("--check", type=int_in(0, 100_000), default=default("check"),
                   help="answers re-asked of the store-off server and compared")
    b.add_argument("--block-size", type=int_in(1, 1 << 16), default=default("block_size"),
                   help="the store's block size in tokens")
    b.add_argument("--seed", type=SEED, default=default("seed"))
    b.add_argument("--peer", choices=SERVE_PEERS[1:], default=None,
                   help="also run the same workload against llama.cpp's llama-server (built once, ~5 min: "
                        "`make llamacpp`) or `vllm serve` (vLLM's environment: `make vllm-env`)")
    b.add_argument("--out", default=default("out"), type=nonempty)
    b.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import writable_dir
    from kvstrata_lab.serve_bench.bench import run as bench

    writable_dir(args.out, "--out")  # refused now, not after the load phases
    cfg = ServeBenchConfig(
        model=args.model, method=args.method, clients=args.clients, turns=args.turns,
        conversations=args.conversations, context=args.context, tool_tokens=args.tool_tokens,
        max_tokens=args.max_tokens, duration_s=args.duration, probe_tokens=args.probe_tokens,
        probe_swa_ttl_s=args.probe_swa_ttl, check=args.check, block_size=args.block_size, seed=args.seed,
        out=args.out, peer=args.peer or "",
    )
    result = bench(cfg)
    print(json.dumps(result["summary"], indent=1))
    print(f"results and plot in {Path(args.out)}")
    return 0
