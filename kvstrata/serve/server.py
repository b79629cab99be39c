"""`kvstrata serve`: assemble model, store, worker and routes from a `ServeConfig`, run uvicorn."""

from __future__ import annotations

import logging
import socket
import sys
import time

from kvstrata.models import check_method, load
from kvstrata.models.loader import refuse_encoder_decoder
from kvstrata.place.config import StoreConfig
from kvstrata.serve.app import Runtime, create_app
from kvstrata.serve.auth import APIKeys
from kvstrata.serve.config import ServeConfig
from kvstrata.serve.metrics import Metrics
from kvstrata.serve.prompts import Prompts
from kvstrata.serve.sessions import Sessions
from kvstrata.serve.worker import Worker
from kvstrata.serve.write_behind import WriteBehindStore


def check_address(host: str, port: int) -> None:
    """Refuse (ValueError) a host that does not resolve, or an address this process cannot listen on,
    before the model loads: each address the host resolves to is bound as uvicorn binds it, then closed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve ({getattr(e, 'strerror', None) or e})") from None
    socks = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
    except OSError as e:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    finally:
        for s in socks:
            s.close()


def build(cfg: ServeConfig):
    """The ASGI app for `cfg` and a line saying where its store is; settings are checked and the store
    opened (its root, secret, Redis) before the model loads."""

    store_cfg = StoreConfig.load(cfg.store_config or None)
    keys = APIKeys.from_file(cfg.api_key_file)
    check_method(cfg.model, cfg.method, store=cfg.use_store)
    refuse_encoder_decoder(cfg.model, "kvstrata serve")
    check_address(cfg.host, cfg.port)
    store = WriteBehindStore.open(store_cfg, int(cfg.memory_global_gb * 2**30)) if cfg.use_store else None
    model, tok = load(cfg.model, cfg.dtype)
    sessions = Sessions(model, cfg.method, store, store_cfg.block_size, cfg.replay_tokens)
    text = model.config.get_text_config()
    prompts = Prompts(tok, text.max_position_embeddings, text.vocab_size)
    metrics = Metrics(store)
    worker = Worker(model, sessions, prompts.decode, prompts.eos_ids(model), prompts.context, metrics,
                    cfg.limits)
    rt = Runtime(cfg, prompts, worker, metrics, keys, store,
                 sessions.namespace[:16] or "no-store", int(time.time()))
    where = (
        "off (every request a full prefill)"
        if store is None
        else (f"Redis {store.global_tier.where}" if store_cfg.redis_url else f"disk {store_cfg.root}")
    )  # never a password
    if store is not None and store.read_only:
        where += f" (read-only: {store.read_only}; hits served, writes refused)"
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
