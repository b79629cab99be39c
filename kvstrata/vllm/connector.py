"""`KvstrataConnector`: vLLM's KV connector (v1 interface) over kvstrata's store.

    vllm serve MODEL_DIR --kv-transfer-config '{"kv_connector": "KvstrataConnector",
      "kv_connector_module_path": "kvstrata.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"method": "nvfp4", "store": "store.toml"}}'

Scheduler side: a new request's chunk chain is looked up in the store (records verified, tensors
not parsed) and only the verified prefix is reported as matched (`plan.Planner`). Worker side:
before a forward, matched chunks are decoded into vLLM's pages (`pages.PageMap`: the backend's own
layout, probed at start); after it, each newly completed chunk is copied out of the pages at once
and encoded and written on a thread of its own (bounded), off the forward path. A record that fails
to load at the worker (gone, damaged, not this key's) is reported through
`get_block_ids_with_load_errors`, and vLLM recomputes from its first block: the connector sets the
engine's `kv_load_failure_policy` to "recompute" for that. Never a wrong KV, never a crash.

Every attention layer's KV of a chunk goes into one global-class record. A model with sliding-window
layers runs here without vLLM's hybrid allocator (this connector does not declare `SupportsHMA`), so
its sliding layers hold full-length pages and a hit restores them exactly.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstrata.names import TierClass
from kvstrata.place.records import RecordError
from kvstrata.place.store import KVStore
from kvstrata.vllm.chunks import ChunkCodec
from kvstrata.vllm.pages import LayoutError, PageMap
from kvstrata.vllm.plan import Planner, StepPlan
from kvstrata.vllm.settings import ConfigError, Settings, records_namespace

log = logging.getLogger("kvstrata.vllm")
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


def _one_openmp_thread() -> None:
    """Encode on the writer thread with one OpenMP thread. A new thread starts with OpenMP's default
    (a team as wide as the machine) whose spinning workers share the cores vLLM's forward is bound
    to: measured, a 6-turn conversation took 7.8 s instead of 4.5. OpenMP's thread count is per
    thread, so this leaves the forward's alone (vLLM replaces `torch.set_num_threads`, which would also
    set MKL's process-wide count). Without torch's bundled libgomp, nothing is changed."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if lib.exists():
        ctypes.CDLL(str(lib)).omp_set_num_threads(1)
    else:
        log.info("kvstrata: no libgomp beside torch (%s): the writer thread keeps OpenMP's default", lib)


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", name)
    if not found:
        raise ConfigError(f"kvstrata connector: cannot tell the layer index of attention layer {name!r}")
    return int(found[-1])


class KvstrataConnector(KVConnectorBase_V1):
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
        self.store = KVStore.from_config(self.settings.store)
        self.ns = records_namespace(model.model, self.codec.text, str(self.dtype).removeprefix("torch."),
                                    self.settings.chunk_tokens)
        if role == KVConnectorRole.SCHEDULER:
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.planner = Planner(self.store, self.ns, self.settings.chunk_tokens, cache.block_size)
        else:
            self.caches: dict[int, torch.Tensor] = {}
            self.pages: PageMap | None = None
            self.failed: set[int] = set()
            self.totals = dict.fromkeys(("loaded_chunks", "loaded_tokens", "load_errors", "saved_chunks",
                                         "write_failures", "bytes_written"), 0)
            self._reported = dict(self.totals)
            self._count_lock = threading.Lock()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-vllm-writer",
                                            initializer=_one_openmp_thread)
            self._room = threading.BoundedSemaphore(MAX_PENDING_CHUNKS)
            self._pending = 0  # chunks handed to the writer and not yet written (or failed)
        log.info("kvstrata connector (%s): method %s, %d tokens per record, store %s", role.name,
                 self.codec.text, self.settings.chunk_tokens, self.settings.store.redis_url or
                 self.settings.store.root)

    # --- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        salt = (request.cache_salt or "").encode()
        n = self.planner.matched(request.request_id, request.all_token_ids, salt, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        salt = (request.cache_salt or "").encode()
        self.planner.allocated(request.request_id, request.all_token_ids, salt, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvstrataMetadata:
        counts = scheduler_output.num_scheduled_tokens
        steps = [(r.req_id, r.block_ids[0], True, r.num_computed_tokens, counts.get(r.req_id, 0))
                 for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            steps.append((req_id, None if new is None else new[0], req_id in cached.resumed_req_ids,
                          cached.num_computed_tokens[i], counts.get(req_id, 0)))
        return KvstrataMetadata(self.planner.step(steps))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None

    # --- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        self.caches = {_layer_index(name): t for name, t in kv_caches.items()}
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

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None:
            return
        size = plan.chunk_tokens
        for item in plan.loads:
            end = (item.first + len(item.keys)) * size if item.stop is None else item.stop
            for j, key in enumerate(item.keys):
                start = (item.first + j) * size
                lo, hi = max(start, item.skip), min(start + size, end)
                try:
                    layers = self._read(key, start, size)
                except RecordError as exc:
                    log.warning("kvstrata: chunk %s of request %s not loaded (%s): recomputed", key[:12],
                                item.req_id, exc)
                    self._count(load_errors=1)
                    self.failed.update(item.blocks[lo // self.block_size:-(-end // self.block_size)])
                    break
                where = self.pages.where(item.blocks, lo, hi - lo)
                span = slice(lo - start, hi - start)
                for i, (k, v) in layers.items():
                    self.pages.scatter(self.caches[i], where, k[:, span], v[:, span])
                self._count(loaded_chunks=1, loaded_tokens=hi - lo)

    def _read(self, key: str, start: int, size: int):
        entry = self.store.entry(TierClass.GLOBAL, key, self.ns)
        if entry is None:
            raise RecordError("no verified record")
        try:
            return self.codec.decode(*entry.open(), start=start, tokens=size)
        except RecordError:
            entry.reject()
            raise

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # every layer of a chunk is copied out at once, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None:
            return
        size = plan.chunk_tokens
        for item in plan.saves:
            for j, key in enumerate(item.keys):
                start = (item.first + j) * size
                where = self.pages.where(item.blocks, start, size)
                layers = {i: self.pages.gather(c, where) for i, c in self.caches.items()}
                self._room.acquire()
                with self._count_lock:
                    self._pending += 1
                self._pool.submit(self._write, key, layers, start)

    def _write(self, key: str, layers: dict, start: int) -> None:
        try:
            tensors, meta = self.codec.encode(layers, start)
            if self.store.put_global(key, tensors, meta, self.ns):
                self._count(saved_chunks=1, bytes_written=sum(t.numel() * t.element_size()
                                                              for t in tensors.values()))
            else:
                self._count(write_failures=1)
        except Exception:  # a failed write is a later miss, never a failed request
            self._count(write_failures=1)
            log.exception("kvstrata: writing chunk %s failed", key[:12])
        finally:
            with self._count_lock:
                self._pending -= 1
            self._room.release()

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
        failed, self.failed = self.failed, set()
        return failed

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._pool.shutdown(wait=True)
            log.info("kvstrata connector: %s", self.totals)
