"""`kvstrata store stats | verify | gc`: the persistent store as an operator sees it."""

from __future__ import annotations

import json


def register(sub) -> None:
    st = sub.add_parser("store",
                        help="inspect the persistent KV store (config: --config TOML or KVSTRATA_STORE_*)")
    st.add_argument("action", choices=("stats", "verify", "gc"),
                    help="stats: what the store holds; verify: read back every record, removing corrupt "
                         "ones; gc: verify, then drop records past retention")
    st.add_argument("--config", help="TOML file with a [store] table")
    st.add_argument("--delete-foreign", action="append", default=[], metavar="SECRET_ID",
                    help="verify / gc: also delete records signed by this secret id (as 'stats' and 'verify' "
                         "show it; 'other-version' for records of another record version). Without it, "
                         "records this store cannot verify are counted and kept: in a shared tier they may "
                         "be another machine's KV")
    st.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.place import KVStore, StoreConfig

    if args.delete_foreign and args.action == "stats":
        raise ValueError("--delete-foreign: only with verify or gc")
    store = KVStore.from_config(StoreConfig.load(args.config))
    if args.action == "stats":
        result = store.stats()
        problems = store.problems(force=True)
        if problems:
            result["problems"] = problems
    else:
        run_ = store.verify if args.action == "verify" else store.gc
        result = run_(tuple(i.lower() for i in args.delete_foreign))
    print(json.dumps(result, indent=1))
    return 0
