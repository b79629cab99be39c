"""`kvstrata vllm-bench`: vLLM alone, with its example connector and with the kvstrata connector, in one
run (`kvstrata_lab.serve_bench.vllm_bench`; flags' defaults from `VllmBenchConfig`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from kvstrata.cli.inputs import BIG, SEED, field_default, int_in, nonempty
from kvstrata_lab.serve_bench.config import VLLM_CONFIGS, VllmBenchConfig


def _names(known: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        out = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in out if x not in known]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} among {', '.join(known)}, "
                                             f"got {text!r}")
        return out

    return parse


def register(sub) -> None:
    def default(name: str):
        return field_default(VllmBenchConfig, name)

    s = sub.add_parser("vllm-bench", help="vLLM's CPU engine alone / + example connector / + kvstrata "
                       "connector: later-turn TTFT, TTFT after a restart, bytes at rest, retrieval")
    s.add_argument("--model", default=default("model"), type=nonempty)
    s.add_argument("--configs", type=_names(VLLM_CONFIGS, "rows"), default=",".join(default("configs")),
                   help="comma-separated rows to run")
    s.add_argument("--clients", type=int_in(1, 64), default=default("clients"),
                   help="agent conversations, played turn by turn")
    s.add_argument("--turns", type=int_in(1, 100), default=default("turns"), help="turns per conversation")
    s.add_argument("--context", type=int_in(1, BIG), default=default("context"),
                   help="tokens of each conversation's document")
    s.add_argument("--tool-tokens", type=int_in(0, BIG), default=default("tool_tokens"),
                   help="tokens of each tool-result turn")
    s.add_argument("--answer-tokens", type=int_in(1, 1024), default=default("answer_tokens"),
                   help="tokens generated per turn")
    s.add_argument("--probe-tokens", type=int_in(1, BIG), default=default("probe_tokens"),
                   help="the prompt timed after an engine restart")
    s.add_argument("--tasks", type=_names(("single", "multikey", "multivalue", "multiquery"), "tasks"),
                   default=",".join(default("tasks")), help="comma-separated retrieval tasks")
    s.add_argument("--n", type=int_in(1, 1000), default=default("n"), help="retrieval instances per task")
    s.add_argument("--length", type=int_in(64, BIG), default=default("length"),
                   help="tokens of each retrieval instance")
    s.add_argument("--chunk-tokens", type=int_in(32, 1 << 16), default=default("chunk_tokens"),
                   help="tokens per kvstrata record (a multiple of vLLM's block size 32)")
    s.add_argument("--hybrid-allocator", choices=("on", "off"),
                   default="on" if default("hybrid_allocator") else "off",
                   help="vLLM's hybrid KV-cache allocator (sliding-window layers hold their window only)")
    s.add_argument("--spec", type=nonempty, default=default("spec"), help="the kvstrata-spec row's spec")
    s.add_argument("--seed", type=SEED, default=default("seed"))
    s.add_argument("--out", default=default("out"), type=nonempty)
    s.add_argument("--work", default=default("work"), help="stores and engine requests (default: a "
                   "temporary directory)")
    s.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import check_context, writable_dir
    from kvstrata.models.loader import check_method, refuse_encoder_decoder
    from kvstrata_lab.serve_bench.vllm_bench import run as bench

    writable_dir(args.out, "--out")
    refuse_encoder_decoder(args.model, "kvstrata vllm-bench (vLLM has no encoder-decoder step)")
    check_context(args.model, max(args.probe_tokens, args.length) + 128,
                  "--probe-tokens" if args.probe_tokens >= args.length else "--length")
    if "kvstrata-spec" in args.configs:
        check_method(args.model, args.spec, store=True)
    cfg = VllmBenchConfig(
        model=args.model, configs=args.configs, clients=args.clients, turns=args.turns, context=args.context,
        tool_tokens=args.tool_tokens, answer_tokens=args.answer_tokens, probe_tokens=args.probe_tokens,
        tasks=args.tasks, n=args.n, length=args.length, chunk_tokens=args.chunk_tokens, spec=args.spec,
        hybrid_allocator=args.hybrid_allocator == "on",
        seed=args.seed, out=args.out, work=args.work)
    result = bench(cfg, command="kvstrata " + shlex.join(sys.argv[1:]))
    print(json.dumps({k: {m: v for m, v in r.items() if m not in ("scores", "answers", "turn_answers")}
                      for k, r in result["rows"].items()}, indent=1))
    print(f"results in {args.out}")
    return 0
