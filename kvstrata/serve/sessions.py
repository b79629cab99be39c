"""Serving a prompt for the model worker: through the persistent store, or uncached (the baseline).

With the store, each tenant salt gets its own `PrefixServer` (same model, store, method and model
fingerprint; computed once) -- longest global-KV prefix hit, SWA state when live, a replay when not
(bounded, or `replay_tokens="exact"`: the sliding windows' receptive field, as a cold run), full prefill on a
miss. Without it, every prompt is one full prefill and nothing is written: what a server without
kvstrata's store does, for `serve-bench`'s ratio.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvstrata.hf.cache import CompressedCache
from kvstrata.methods import parse_method, storable
from kvstrata.names import Retention, ServeKind
from kvstrata.place.prefix_keys import model_fingerprint
from kvstrata.place.prefix_server import Prefill, PrefixServer, ReplayTokens, Served, weights_digest
from kvstrata.serve.write_behind import WriteBehindStore

MAX_TENANTS = 4096  # PrefixServers kept; one is cheap to rebuild (no weight hashing)


class Sessions:
    def __init__(self, model, method: str, store: WriteBehindStore | None, block_size: int = 256,
                 replay_tokens: ReplayTokens = None):
        self.model, self.store, self.block, self.n_win = model, store, block_size, replay_tokens
        self.method = method
        self.spec = parse_method(method)
        # a keep policy acts once, on the whole prompt: such prompts are not cut into chunks
        self.whole = any(r.keep is not None for r in self.spec.recipes())
        self._servers: OrderedDict[bytes, PrefixServer] = OrderedDict()
        self.fingerprint = None
        self.namespace = ""
        if store is not None:
            self.fingerprint = model_fingerprint(model.config.to_dict(), weights_digest(model))
            self.namespace = self._server(b"").ns.hex()  # refuses methods the store cannot hold, at startup

    def _server(self, tenant: bytes) -> PrefixServer:
        server = self._servers.get(tenant)
        if server is None:
            server = PrefixServer(
                self.model, self.store, self.method, block_size=self.block, n_win=self.n_win, tenant=tenant,
                fingerprint=self.fingerprint,
            )
            self._servers[tenant] = server
            if len(self._servers) > MAX_TENANTS:
                self._servers.popitem(last=False)
        self._servers.move_to_end(tenant)
        return server

    def begin(self, ids: list[int], tenant: bytes, retention: Retention) -> Prefill:
        """The prompt looked up and installed, the rest left to feed; with the store, new blocks are
        queued for writing under `retention` when it finishes."""
        if self.store is None:  # cut and sealed as with a store, so answers do not depend on it
            cache = CompressedCache(self.model.config, self.spec)
            prefill = Prefill(cache=cache, ids=ids, pos=0, kind=ServeKind.MISS, reused_tokens=0,
                              t0=time.perf_counter(), block=self.block if storable(self.spec) else None)
        else:
            prefill = self._server(tenant).begin(ids, retention)
        prefill.whole = self.whole
        return prefill

    def serve(self, ids: list[int], tenant: bytes, retention: Retention) -> Served:
        """The prompt's cache and next-token logits (one forward per store boundary)."""
        return self.begin(ids, tenant, retention).run(self.model)
