"""`kvstrata chat`: a multi-turn session over the persistent store, hit / replay / miss per turn."""

from __future__ import annotations

import sys

from kvstrata.cli.inputs import BIG, int_in, nonempty


def register(sub) -> None:
    ch = sub.add_parser("chat",
                        help="multi-turn session over the persistent store: hit / replay / miss per turn")
    ch.add_argument("--model", default="gemma3-270m")
    ch.add_argument("--method", default="nvfp4;sliding=fp8", type=nonempty)
    ch.add_argument("--script",
                    help="UTF-8 file of turns separated by lines of '---' (default: one turn per stdin line)")
    ch.add_argument("--config", help="store TOML ([store] table); env KVSTRATA_STORE_* also apply")
    ch.add_argument("--tenant", default="default", type=nonempty)
    ch.add_argument("--max-new-tokens", type=int_in(1, 100_000), default=32)
    ch.add_argument("--forget-swa-before", type=int_in(1, BIG), nargs="*",
                    help="turn numbers before which the SWA pool is emptied")
    ch.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import SCRIPT_MAX_BYTES, parse_method_early
    from kvstrata.models import load
    from kvstrata.place import KVStore, StoreConfig
    from kvstrata.place.chat import chat
    from kvstrata.place.prefix_server import PrefixServer
    from kvstrata.user_files import read_text_file

    parse_method_early(args.method)
    cfg = StoreConfig.load(args.config)
    script = read_text_file(args.script, "--script", SCRIPT_MAX_BYTES) if args.script else None
    store = KVStore.from_config(cfg)
    model, tok = load(args.model)
    server = PrefixServer(model, store, args.method, block_size=cfg.block_size, tenant=args.tenant.encode())
    source = script.split("\n---\n") if script is not None else (line for line in sys.stdin)
    turns = [t.strip() for t in source if t.strip()]
    if script is not None and not turns:
        raise ValueError(f"--script: {args.script} holds no turns")
    chat(model, tok, server, turns, args.max_new_tokens, set(args.forget_swa_before or []), out=sys.stdout)
    return 0
