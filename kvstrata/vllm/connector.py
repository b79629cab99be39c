"""`KvstrataConnector`: vLLM's KV connector (v1 interface) over kvstrata's store.

    vllm serve MODEL_DIR --kv-transfer-config '{"kv_connector": "KvstrataConnector",
      "kv_connector_module_path": "kvstrata.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"method": "nvfp4", "store": "store.toml"}}'

Scheduler side: a new request's chunk chain is looked up in the store (records verified, tensors
not parsed) and only the verified prefix is reported as matched (`plan.Planner`); the request waits
for its load (vLLM's asynchronous load: one engine step). Worker side: matched chunks are decoded
into the request's pages (`pages.PageMap`: the backend's own layout, probed at start); after each
forward, every newly completed chunk is copied out of the pages at once and encoded and written on a
thread of its own (bounded), off the forward path. A record that fails to load at the worker (gone,
damaged, not this key's) fails the request's load (`failed_recving`) and vLLM recomputes it: the
connector sets the engine's `kv_load_failure_policy` to "recompute" for that. Never a wrong KV, never
a crash.

Hybrid models (`SupportsHMA`): with vLLM's hybrid allocator, full-attention groups' layers of a chunk
go into a global-class record (the persistent tier, days) and sliding-window groups' layers into an
SWA-class record in the store's pool (minutes), saved as each chunk completes -- while the window
still holds it. A hit needs both (`plan`). With the allocator off (`--disable-hybrid-kv-cache-manager`)
every layer is full length and goes into the global record.

Lifecycle: at start each side logs (through vLLM's logger) the store, the method and the secret id it
signs with; the worker runs its load path once on one chunk of random K/V before the first request
on the forward's thread (so the first hit pays no one-time cost there); writes encode on a thread of
one OpenMP thread (`threads`); at shutdown each side logs its counters. A store with another fleet's
secret misses on that fleet's records and its writes of them are skipped, counted
(`writes_skipped_foreign`); a read-only store (`read_only`, or a root found not writable) serves hits
and the worker does not encode chunks it could not write (`writes_refused_read_only`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from kvstrata.names import TierClass
from kvstrata.place.records import RecordError, secret_id
from kvstrata.place.tier import StoreUnavailable
from kvstrata.vllm.chunks import ChunkCodec
from kvstrata.vllm.groups import engine_groups, layer_index
from kvstrata.vllm.pages import LayoutError, PageMap
from kvstrata.vllm.plan import NULL_BLOCK, Chunks, Planner, StepPlan
from kvstrata.vllm.settings import ConfigError, Settings, records_namespace, shared_store
from kvstrata.vllm.threads import one_openmp_thread

log = init_logger("vllm.kvstrata.connector")  # vLLM's handlers, format and VLLM_LOGGING_LEVEL
MAX_PENDING_CHUNKS = 64  # chunks copied out and waiting to be encoded and written (back-pressure beyond)


class KvstrataMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


class KvstrataStats(KVConnectorStats):
    """The worker's counters since the last report (vLLM's connector stats hook; summed across workers)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvstrataStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvstrataConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cache = vllm_config.cache_config
        if cache.cache_dtype not in ("auto", None):
            raise ConfigError(f"kvstrata connector: kv_cache_dtype {cache.cache_dtype!r}: the connector "
                              "encodes the engine's own KV; leave kv_cache_dtype at 'auto'")
        self.settings = Settings.parse(self._kv_transfer_config.kv_connector_extra_config, cache.block_size)
        self.block_size = cache.block_size
        model = vllm_config.model_config
        self.dtype = model.dtype
        text_config = model.hf_config.get_text_config()
        self.kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = model.get_head_size()
        n_layers = text_config.num_hidden_layers
        kinds = list(getattr(text_config, "layer_types", None) or ["full_attention"] * n_layers)
        self.layer_classes = ["sliding" if k == "sliding_attention" else "full" for k in kinds]
        try:
            self.codec = ChunkCodec.build(self.settings.method, self.layer_classes, self.kv_heads,
                                          self.head_dim, self.dtype)
        except ValueError as exc:
            raise ConfigError(f"kvstrata connector: method {self.settings.method!r}: {exc}") from None
        self.groups = engine_groups(self._kv_cache_config, n_layers)
        windows = [w for w in self.groups.windows if w is not None]
        if windows and self.settings.chunk_tokens > min(windows):
            raise ConfigError(f"kvstrata connector: chunk_tokens {self.settings.chunk_tokens} exceeds the "
                              f"sliding window ({min(windows)} tokens): a chunk's window KV would be freed "
                              "before it completes")
        self.group_of = {i: g for g, layers in enumerate(self.groups.layers) for i in layers}
        # one store per process: the scheduler's lookups see the SWA pool the worker writes
        try:
            self.store = shared_store(self.settings.store)
        except (ValueError, OSError, StoreUnavailable) as exc:  # a missing secret file, a bad root, no Redis
            raise ConfigError(f"kvstrata connector: store: {exc}") from None
        self.ns = records_namespace(model.model, self.codec.text, str(self.dtype).removeprefix("torch."),
                                    self.settings.chunk_tokens, self.groups.pooled)
        if role == KVConnectorRole.SCHEDULER:
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.planner = Planner(self.store, self.ns, self.settings.chunk_tokens, cache.block_size,
                                   self.groups)
        else:
            self.caches: dict[int, torch.Tensor] = {}
            self.pages: PageMap | None = None
            self.loaded: set[str] = set()  # requests whose load ended (well or not) since the last report
            self.failed: set[str] = set()  # ... of them, those whose load failed: vLLM recomputes them
            self.totals = dict.fromkeys(("loaded_chunks", "loaded_tokens", "load_errors", "saved_chunks",
                                         "write_failures", "bytes_written", "pool_chunks", "pool_bytes",
                                         "pool_loaded", "writes_skipped_foreign", "writes_refused_read_only",
                                         ), 0)
            self._reported = dict(self.totals)
            self._count_lock = threading.Lock()
            self._pool = one_openmp_thread("kvstrata-vllm-writer")
            self._room = threading.BoundedSemaphore(MAX_PENDING_CHUNKS)
            self._pending = 0  # chunks handed to the writer and not yet written (or failed)
        log.info("kvstrata connector (%s): store %s, method %s, %d tokens per record, secret id %s, "
                 "layers %s persistent, %s in the SWA pool", role.name, self._store_text(), self.codec.text,
                 self.settings.chunk_tokens, secret_id(self.store.secret).hex(), list(self.groups.persistent),
                 list(self.groups.pooled))

    def _store_text(self) -> str:
        """The store as the log shows it (never a password)."""
        tier = self.store.global_tier
        where = f"Redis {tier.where}" if self.settings.store.redis_url else f"disk {tier.root}"
        return where + (f" (read-only: {self.store.read_only})" if self.store.read_only else "")

    # --- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        salt = (request.cache_salt or "").encode()
        n = self.planner.matched(request.request_id, request.all_token_ids, salt, num_computed_tokens)
        return n, n > 0  # loaded while the request waits: a failed load is then the request's alone

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        salt = (request.cache_salt or "").encode()
        ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self.planner.allocated(request.request_id, request.all_token_ids, salt, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output) -> KvstrataMetadata:
        counts = scheduler_output.num_scheduled_tokens
        steps = [(r.req_id, r.block_ids, True, r.num_computed_tokens, counts.get(r.req_id, 0))
                 for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            steps.append((req_id, cached.new_block_ids[i], req_id in cached.resumed_req_ids,
                          cached.num_computed_tokens[i], counts.get(req_id, 0)))
        return KvstrataMetadata(self.planner.step(steps))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)  # chunks were copied out as they completed

    # --- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        self.caches = {layer_index(name): t for name, t in kv_caches.items()}
        if sorted(self.caches) != list(range(len(self.layer_classes))):
            raise ConfigError(f"kvstrata connector: attention layers {sorted(self.caches)} do not match the "
                              f"model's {len(self.layer_classes)} layers")
        name, cache = next(iter(kv_caches.items()))
        layer = layers[name]
        try:
            self.pages = PageMap.probe(
                cache, lambda k, v, c, slots: layer.impl.do_kv_cache_update(layer, k, v, c, slots),
                num_blocks=self._kv_cache_config.num_blocks, block_size=self.block_size,
                kv_heads=self.kv_heads, head_dim=self.head_dim)
        except (TypeError, AttributeError, LayoutError) as exc:  # MLA latents, a backend without the hook
            raise ConfigError(f"kvstrata connector: cannot map {type(layer.impl).__name__}'s KV pages: {exc} "
                              "(K/V attention layers only; MLA latents are not supported)") from None
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        if len(shapes) != 1:
            raise ConfigError(f"kvstrata connector: attention layers hold pages of different shapes {shapes}")
        self._warm()

    def _warm(self) -> None:
        """The load path run once before the first request (`ChunkCodec.warm`, and page offsets), so the
        first hit after a start pays no one-time cost; nothing stored, nothing written into the pages."""
        t0, size = time.perf_counter(), self.settings.chunk_tokens
        for layers in (self.groups.persistent, self.groups.pooled):
            self.codec.warm(layers, size, self.store.secret)
        self.pages.where([0] * -(-size // self.block_size), 0, size)
        log.info("kvstrata connector (WORKER): load path warmed in %.2f s", time.perf_counter() - t0)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None:
            return
        for item in plan.loads:
            try:
                self._load(item, plan.chunk_tokens)
            except RecordError as exc:
                log.warning("kvstrata: request %s's load stopped (%s): recomputed", item.req_id, exc)
                self._count(load_errors=1)
                self.failed.add(item.req_id)
            self.loaded.add(item.req_id)

    def _load(self, item: Chunks, size: int) -> None:
        """Decode a request's hit chunks into its pages: every layer from `skip` to `stop`, a sliding
        group's only where it still holds blocks; raises `RecordError` at the first chunk that fails."""
        kinds = [(TierClass.GLOBAL, self.groups.persistent), (TierClass.SWA, self.groups.pooled)]
        for j, key in enumerate(item.keys):
            start = (item.first + j) * size
            lo, hi = max(start, item.skip), min(start + size, item.stop)
            for klass, layers in kinds:
                spans = {g: (max(lo, self.groups.kept_from(g, item.stop, self.block_size)), hi)
                         for g in {self.group_of[i] for i in layers}}
                if not layers or all(a >= b for a, b in spans.values()):
                    continue
                decoded = self._read(klass, key, start, size, layers)
                where = {g: self._where(item.blocks[g], a, b) for g, (a, b) in spans.items() if a < b}
                for i, (k, v) in decoded.items():
                    g = self.group_of[i]
                    if g in where:
                        a, b = spans[g]
                        self.pages.scatter(self.caches[i], where[g], k[:, a - start:b - start],
                                           v[:, a - start:b - start])
                if klass is TierClass.SWA:
                    self._count(pool_loaded=1)
            self._count(loaded_chunks=1, loaded_tokens=hi - lo)

    def _where(self, blocks: list[int], first: int, end: int):
        """Flat offsets of positions [first, end) in a group's pages; `RecordError` if the group does not
        hold them all (nothing is written where vLLM keeps no block)."""
        if any(b == NULL_BLOCK for b in blocks[first // self.block_size: -(-end // self.block_size)]):
            raise RecordError(f"positions {first}..{end} are not all held by the request's blocks")
        return self.pages.where(blocks, first, end - first)

    def _read(self, klass: TierClass, key: str, start: int, size: int, layers: tuple[int, ...]):
        entry = self.store.entry(klass, key, self.ns)
        if entry is None:
            raise RecordError(f"no verified {klass.value} record")
        try:
            return self.codec.decode(*entry.open(), start=start, tokens=size, layers=layers)
        except RecordError:
            entry.reject()
            raise

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose load ended this step (a failed one also in `failed_recving`: recomputed)."""
        done, failed = self.loaded, self.failed
        self.loaded, self.failed = set(), set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # every layer of a chunk is copied out at once, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None:
            return
        size = plan.chunk_tokens
        kinds = [(TierClass.GLOBAL, self.groups.persistent), (TierClass.SWA, self.groups.pooled)]
        if self.store.read_only and self.groups.persistent:  # copy and encode nothing it cannot write
            kinds = kinds[1:]
            self._count(writes_refused_read_only=sum(len(item.keys) for item in plan.saves))
        for item in plan.saves:
            for j, key in enumerate(item.keys):
                start = (item.first + j) * size
                parts = {klass: self._gather(item.blocks, layers, start, start + size)
                         for klass, layers in kinds if layers}
                if not parts:
                    continue
                self._room.acquire()
                with self._count_lock:
                    self._pending += 1
                self._pool.submit(self._write, key, parts, start)

    def _gather(self, blocks: tuple[list[int], ...], layers: tuple[int, ...], first: int, end: int):
        """Copies of `layers`' K, V at positions [first, end), or None where a group no longer holds them."""
        try:
            where = {g: self._where(blocks[g], first, end) for g in {self.group_of[i] for i in layers}}
        except RecordError:
            return None
        return {i: self.pages.gather(self.caches[i], where[self.group_of[i]]) for i in layers}

    def _write(self, key: str, parts: dict, start: int) -> None:
        try:
            for klass, layers in parts.items():
                self._write_part(key, klass, layers, start)
        finally:
            with self._count_lock:
                self._pending -= 1
            self._room.release()

    def _write_part(self, key: str, klass: TierClass, layers: dict | None, start: int) -> None:
        pooled = klass is TierClass.SWA
        try:
            if layers is None:
                raise RecordError("the window no longer holds the chunk")
            tensors, meta = self.codec.encode(layers, start)
            put, tier = ((self.store.put_swa, self.store.swa_tier) if pooled else
                         (self.store.put_global, self.store.global_tier))
            skipped = tier.stats.writes_skipped_foreign  # this thread is the process's only writer
            if not put(key, tensors, meta, self.ns):
                if tier.stats.writes_skipped_foreign > skipped:  # another secret's record: left alone
                    self._count(writes_skipped_foreign=1)
                    return
                raise RecordError("the tier refused it (full, read-only or unreachable)")
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._count(**({"pool_chunks": 1, "pool_bytes": nbytes} if pooled else
                           {"saved_chunks": 1, "bytes_written": nbytes}))
        except RecordError as exc:  # refused: counted, one line (never a traceback per chunk)
            self._count(write_failures=1)
            log.warning("kvstrata: chunk %s (%s) not written: %s", key[:12], klass.value, exc)
        except Exception:  # a failed write is a later miss, never a failed request
            self._count(write_failures=1)
            log.exception("kvstrata: writing chunk %s (%s) failed", key[:12], klass.value)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every chunk handed to the writer is written (or failed); False on timeout."""
        end = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < end:
            time.sleep(0.01)
        return not self._pending

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvstrataMetadata) else None

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, value in deltas.items():
                self.totals[name] += value

    def get_kv_connector_stats(self) -> KvstrataStats | None:
        """The counters since the last call (`totals` keeps them since the start)."""
        if self._role != KVConnectorRole.WORKER:
            return None
        with self._count_lock:
            delta = {k: v - self._reported[k] for k, v in self.totals.items()}
            self._reported = dict(self.totals)
        return KvstrataStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KvstrataStats:
        return KvstrataStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # loads are asynchronous: a failed one is the request's (`get_transfer_results`)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._pool.shutdown(wait=True)
            log.info("kvstrata connector (WORKER) shutting down: %s; store %s", self.totals,
                     self._store_counts())
        else:
            log.info("kvstrata connector (SCHEDULER) shutting down: %s; store %s", self.planner.stats,
                     self._store_counts())

    def _store_counts(self) -> dict:
        """The persistent tier's counters (hits, misses, unverifiable, skipped, ...), those not zero."""
        return {k: v for k, v in asdict(self.store.global_tier.stats).items() if v and k != "extra"}
