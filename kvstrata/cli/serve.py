"""`kvstrata serve`: its parser (defaults from `ServeConfig`) and what it does."""

from __future__ import annotations

import argparse

from kvstrata.cli.inputs import BIG, field_default, float_in, int_in, nonempty
from kvstrata.serve.config import RETENTIONS, ServeConfig
from kvstrata.settings import DTYPES, EXACT, ReplayTokens

DAY_S = 86400.0
REPLAY_HELP = (f"tokens replayed on an SWA miss, or '{EXACT}': the receptive field of the sliding windows, "
               "whose answers equal a cold run's (default: 2 sliding windows, bounded and approximate)")


def replay_tokens(text: str) -> ReplayTokens:
    """argparse type: a token count or 'exact' (`--replay-tokens`)."""
    if text.strip().lower() == EXACT:
        return EXACT
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= BIG:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens >= 0 or '{EXACT}', got {text!r}")
    return value


def register(sub) -> None:
    def default(name: str):
        return field_default(ServeConfig, name)

    s = sub.add_parser("serve", help="OpenAI-compatible server whose sessions live in the persistent KV "
                                     "store")
    s.add_argument("--model", required=True, type=nonempty, help="smollm2-135m, gemma3-270m, tiny-llama, "
                   "tiny-gemma3, or a local model directory")
    s.add_argument("--method", default=default("method"), type=nonempty,
                   help="method spec the store keeps KV in, e.g. nvfp4;sliding=fp8")
    s.add_argument("--config", help="store TOML ([store] table); env KVSTRATA_STORE_* also apply")
    s.add_argument("--host", default=default("host"), type=nonempty,
                   help="address to listen on (0.0.0.0: every interface; use --api-key-file then)")
    s.add_argument("--port", type=int_in(1, 65535), default=default("port"), help="port to listen on")
    s.add_argument("--api-key-file", help="one key per line; requests need 'Authorization: Bearer <key>'")
    s.add_argument("--served-model-name", type=nonempty, help="the model name clients send (default: --model "
                                                              "as given)")
    s.add_argument("--no-store", action="store_true", help="every request a full prefill, nothing cached "
                                                           "(baseline)")
    s.add_argument("--max-running", "--max-active", dest="max_running", type=int_in(1, 1024),
                   default=default("max_running"), help="requests in the worker's batch at once")
    s.add_argument("--max-queue", type=int_in(0, 100_000), default=default("max_queue"),
                   help="requests waiting beyond those; more get 429")
    s.add_argument("--max-batched-tokens", type=int_in(1, BIG), default=default("max_batched_tokens"),
                   help="tokens per batched forward: one per decoding request, prefill chunks in the rest")
    s.add_argument("--prefill-chunk", type=int_in(1, BIG), default=default("prefill_chunk"),
                   help="most tokens of one prompt per step (<= --max-batched-tokens)")
    s.add_argument("--kv-budget-mb", type=float_in(0.0, 1e9), default=default("kv_budget_mb"),
                   help="KV (compressed bytes) the running requests may hold at their longest; a request "
                        "that does not fit waits (0: no limit)")
    s.add_argument("--no-batching", action="store_true",
                   help="one request per forward (the unbatched worker, for comparison)")
    s.add_argument("--request-timeout", type=float_in(0.01, 7 * DAY_S), default=default("request_timeout_s"),
                   help="deadline per request, seconds")
    s.add_argument("--default-max-tokens", type=int_in(1, BIG), default=default("default_max_tokens"),
                   help="when a request names none")
    s.add_argument("--replay-tokens", type=replay_tokens, help=REPLAY_HELP)
    s.add_argument("--default-retention", default=default("default_retention"), choices=RETENTIONS,
                   help="prompt_cache_retention of requests that give none")
    s.add_argument("--memory-global-gb", type=float_in(0.001, 1e6), default=default("memory_global_gb"),
                   help="RAM for 'in_memory' global KV")
    s.add_argument("--dtype", choices=DTYPES, default=default("dtype"),
                   help="the model's weights and activations (bf16: fast on CPUs with AVX512-BF16)")
    s.add_argument("--log-level", default=default("log_level"),
                   choices=("critical", "error", "warning", "info", "debug"), help="the server's log level")
    s.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import model_name

    model_name(args.model)  # a mistyped model is named at once (before torch loads)
    from kvstrata.serve.server import run as serve

    cfg = ServeConfig(
        model=args.model, method=args.method, served_model_name=args.served_model_name or "",
        host=args.host, port=args.port, api_key_file=args.api_key_file or "",
        store_config=args.config or "", use_store=not args.no_store, max_running=args.max_running,
        max_queue=args.max_queue, max_batched_tokens=args.max_batched_tokens,
        prefill_chunk=args.prefill_chunk,
        kv_budget_mb=args.kv_budget_mb, batching=not args.no_batching, request_timeout_s=args.request_timeout,
        default_max_tokens=args.default_max_tokens, replay_tokens=args.replay_tokens,
        default_retention=args.default_retention, memory_global_gb=args.memory_global_gb,
        log_level=args.log_level, dtype=args.dtype,
    )
    return serve(cfg)
