"""`kvstrata serve` and `kvstrata serve-bench`: their parsers and what they do."""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.cli.inputs import BIG, SEED, float_in, int_in, nonempty

DAY_S = 86400.0


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server whose sessions live in the persistent KV "
                                     "store")
    s.add_argument("--model", required=True, type=nonempty, help="smollm2-135m, gemma3-270m, tiny-llama, "
                   "tiny-gemma3, or a local model directory")
    s.add_argument("--method", default="bf16", type=nonempty, help="method spec the store keeps KV in, e.g. "
                                                                   "nvfp4;sliding=fp8")
    s.add_argument("--config", help="store TOML ([store] table); env KVSTRATA_STORE_* also apply")
    s.add_argument("--host", default="127.0.0.1", type=nonempty)
    s.add_argument("--port", type=int_in(1, 65535), default=8000)
    s.add_argument("--api-key-file", help="one key per line; requests need 'Authorization: Bearer <key>'")
    s.add_argument("--served-model-name", type=nonempty, help="the model name clients send (default: --model "
                                                              "as given)")
    s.add_argument("--no-store", action="store_true", help="every request a full prefill, nothing cached "
                                                           "(baseline)")
    s.add_argument("--max-active", type=int_in(1, 1024), default=4, help="requests interleaved step by step "
                                                                         "in the worker")
    s.add_argument("--max-queue", type=int_in(0, 100_000), default=16, help="requests waiting beyond those; "
                                                                            "more get 429")
    s.add_argument(
        "--request-timeout", type=float_in(0.01, 7 * DAY_S), default=300.0,
        help="deadline per request, seconds",
    )
    s.add_argument("--default-max-tokens", type=int_in(1, BIG), default=256, help="when a request names none")
    s.add_argument(
        "--replay-tokens", type=int_in(0, BIG),
        help="tokens replayed on an SWA miss (default: 2 sliding windows)",
    )
    s.add_argument(
        "--default-retention", default="24h", choices=("24h", "in_memory"),
        help="prompt_cache_retention of requests that give none",
    )
    s.add_argument(
        "--memory-global-gb", type=float_in(0.001, 1e6), default=1.0, help="RAM for 'in_memory' global KV"
    )
    s.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser(
        "serve-bench",
        help="load + fault harness: N openai clients, multi-turn agent sessions, store on vs off",
    )
    b.add_argument("--model", default="gemma3-270m", type=nonempty)
    b.add_argument("--method", default="bf16", type=nonempty)
    b.add_argument("--clients", type=int_in(1, 1024), default=8)
    b.add_argument("--turns", type=int_in(1, 10_000), default=12, help="turns per conversation")
    b.add_argument("--conversations", type=int_in(1, 10_000), default=1, help="conversations per client")
    b.add_argument(
        "--context", type=int_in(1, BIG), default=2048, help="tokens of each conversation's opening document"
    )
    b.add_argument("--tool-tokens", type=int_in(0, BIG), default=200, help="tokens of each tool-result turn")
    b.add_argument("--max-tokens", type=int_in(1, BIG), default=16, help="tokens generated per turn")
    b.add_argument(
        "--duration", type=float_in(1, 7 * DAY_S), default=1800.0, help="seconds each phase may run at most"
    )
    b.add_argument(
        "--probe-tokens", type=int_in(0, BIG), default=8192,
        help="single-client cold / warm / replay probe at this prompt length (0: skip)",
    )
    b.add_argument(
        "--probe-swa-ttl", type=float_in(1, 3600), default=30.0,
        help="the probe server's SWA TTL, seconds: warm turns come within it, the replay turn after it",
    )
    b.add_argument(
        "--check", type=int_in(0, 100_000), default=8,
        help="answers re-asked of the store-off server and compared",
    )
    b.add_argument("--block-size", type=int_in(1, 1 << 16), default=256)
    b.add_argument("--seed", type=SEED, default=0)
    b.add_argument("--out", default="docs/results/serve", type=nonempty)
    b.set_defaults(func=cmd_serve_bench)


def cmd_serve(args) -> int:
    from kvstrata.serve.config import ServeConfig
    from kvstrata.serve.server import run

    cfg = ServeConfig(
        model=args.model, method=args.method, served_model_name=args.served_model_name or "",
        host=args.host, port=args.port, api_key_file=args.api_key_file or "",
        store_config=args.config or "", use_store=not args.no_store, max_active=args.max_active,
        max_queue=args.max_queue, request_timeout_s=args.request_timeout,
        default_max_tokens=args.default_max_tokens, replay_tokens=args.replay_tokens,
        default_retention=args.default_retention, memory_global_gb=args.memory_global_gb,
        log_level=args.log_level,
    )
    return run(cfg)


def cmd_serve_bench(args) -> int:
    from kvstrata.serve.bench import BenchConfig, run

    cfg = BenchConfig(
        model=args.model, method=args.method, clients=args.clients, turns=args.turns,
        conversations=args.conversations, context=args.context, tool_tokens=args.tool_tokens,
        max_tokens=args.max_tokens, duration_s=args.duration, probe_tokens=args.probe_tokens,
        probe_swa_ttl_s=args.probe_swa_ttl, check=args.check, block_size=args.block_size, seed=args.seed,
        out=args.out,
    )
    result = run(cfg)
    print(json.dumps(result["summary"], indent=1))
    print(f"results and plot in {Path(args.out)}")
    return 0
