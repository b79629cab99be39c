"""`kvstrata store stats | verify | gc`: the persistent store as an operator sees it."""

from __future__ import annotations

import json


def register(sub) -> None:
    st = sub.add_parser("store",
                        help="inspect the persistent KV store (config: --config TOML or KVSTRATA_STORE_*)")
    st.add_argument("action", choices=("stats", "verify", "gc"))
    st.add_argument("--config", help="TOML file with a [store] table")
    st.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.place import KVStore, StoreConfig

    store = KVStore.from_config(StoreConfig.load(args.config))
    result = {"stats": store.stats, "verify": store.verify, "gc": store.gc}[args.action]()
    print(json.dumps(result, indent=1))
    return 0
