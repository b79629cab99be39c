"""`kvstrata serve`: assemble model, store, worker and routes from a `ServeConfig`, run uvicorn."""

from __future__ import annotations

import logging
import sys
import time

from kvstrata.methods import parse_method
from kvstrata.models import load
from kvstrata.models.loader import check
from kvstrata.place.config import StoreConfig
from kvstrata.serve.app import Runtime, create_app
from kvstrata.serve.auth import APIKeys
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.metrics import Metrics
from kvstrata.serve.prompts import Prompts
from kvstrata.serve.sessions import Sessions
from kvstrata.serve.worker import Worker
from kvstrata.serve.write_behind import WriteBehindStore


def build(cfg: ServeConfig):
    """The ASGI app for `cfg` and a line saying where its store is; settings are checked and the store
    opened (its root, secret, Redis) before the model loads."""

    store_cfg = StoreConfig.load(cfg.store_config or None)
    keys = APIKeys.from_file(cfg.api_key_file)
    parse_method(cfg.method)
    check(cfg.model)
    store = WriteBehindStore.open(store_cfg, int(cfg.memory_global_gb * 2**30)) if cfg.use_store else None
    model, tok = load(cfg.model)
    sessions = Sessions(model, cfg.method, store, store_cfg.block_size, cfg.replay_tokens)
    text = model.config.get_text_config()
    prompts = Prompts(tok, text.max_position_embeddings, text.vocab_size)
    metrics = Metrics(store)
    worker = Worker(model, sessions, prompts.decode, prompts.eos_ids(model), prompts.context, metrics,
                    cfg.max_active, cfg.max_queue)
    rt = Runtime(cfg, prompts, worker, metrics, keys, store,
                 sessions.namespace[:16] or "no-store", int(time.time()))
    where = (
        "off (every request a full prefill)"
        if store is None
        else (f"Redis {store.global_tier.where}" if store_cfg.redis_url else f"disk {store_cfg.root}")
    )  # never a password
    return create_app(rt), f"store {where}; block {store_cfg.block_size} tokens"


def run(cfg: ServeConfig) -> int:
    import uvicorn  # optional dependency (the serve extra)

    app, store = build(cfg)
    print(
        f"kvstrata serve: {cfg.name} ({cfg.method}) on http://{cfg.host}:{cfg.port}/v1; {store}",
        file=sys.stderr, flush=True,
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    return 0
