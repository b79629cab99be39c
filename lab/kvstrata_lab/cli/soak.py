"""`kvstrata serve-soak`: the agent workload against a server on a Redis Cluster under faults
(`kvstrata_lab.serve_bench.soak`)."""

from __future__ import annotations

import json
import shlex
import sys

from kvstrata.cli.inputs import BIG, field_default, float_in, int_in, nonempty
from kvstrata_lab.serve_bench.config import SoakConfig

DAY_S = 86400.0


def register(sub) -> None:
    load = SoakConfig().load

    s = sub.add_parser("serve-soak", help="agent load on a 3-master Redis Cluster while a master, the server "
                                          "and the cluster's memory fail; every answer checked")
    s.add_argument("--model", default=load.model, type=nonempty)
    s.add_argument("--method", default=load.method, type=nonempty)
    s.add_argument("--clients", type=int_in(1, 1024), default=load.clients, help="concurrent openai clients")
    s.add_argument("--turns", type=int_in(1, 10_000), default=load.turns, help="turns per conversation")
    s.add_argument("--conversations", type=int_in(1, 10_000), default=100, help="conversations per client")
    s.add_argument("--context", type=int_in(1, BIG), default=load.context,
                   help="tokens of each conversation's opening document")
    s.add_argument("--max-tokens", type=int_in(1, BIG), default=load.max_tokens,
                   help="tokens generated per turn")
    s.add_argument("--duration", type=float_in(60, 7 * DAY_S), default=load.duration_s,
                   help="seconds of load")
    s.add_argument("--check", type=int_in(0, 100_000), default=load.check,
                   help="answers re-asked of a store-off server besides every one within a minute of a fault")
    s.add_argument("--retries", type=int_in(0, 100), default=field_default(SoakConfig, "retries"),
                   help="times a turn failed by the server's restart is asked again")
    s.add_argument("--request-timeout", type=float_in(1, DAY_S),
                   default=field_default(SoakConfig, "request_timeout_s"),
                   help="seconds after which a request counts as hung")
    s.add_argument("--replay-tokens", type=nonempty,
                   help="passed to both servers' --replay-tokens (a model with sliding layers: replays that "
                        "cover their receptive field keep answers equal to the store-off server's)")
    s.add_argument("--out", default="docs/results/soak", type=nonempty)
    s.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import replace

    from kvstrata.cli.inputs import writable_dir
    from kvstrata_lab.serve_bench import soak

    writable_dir(args.out, "--out")
    base = SoakConfig()
    server_args = ("--replay-tokens", args.replay_tokens) if args.replay_tokens else ()
    cfg = replace(base, retries=args.retries, request_timeout_s=args.request_timeout, server_args=server_args,
                  load=replace(
        base.load, model=args.model, method=args.method, clients=args.clients, turns=args.turns,
        conversations=args.conversations, context=args.context, max_tokens=args.max_tokens,
        duration_s=args.duration, check=args.check, out=args.out))
    result = soak.run(cfg, command="kvstrata " + shlex.join(sys.argv[1:]))
    print(json.dumps({k: result[k] for k in ("requests", "check", "counters")}, indent=1))
    print(f"results in {args.out}")
    return 0
