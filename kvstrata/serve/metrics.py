"""Prometheus metrics (prometheus-client), one registry per server.

Request-side series are counted as requests finish; the store's tier counters (hits, misses,
corrupt records removed, transport errors, ...) are read from each tier's `TierStats` at scrape
time, so a Redis that went away shows up as `kvstrata_store_errors_total{tier="global"}`, writes another
secret's records kept from as `kvstrata_store_writes_skipped_foreign_total`, a read-only store as
`kvstrata_store_read_only 1` and its refused writes as `kvstrata_store_refused_read_only_total`.
"""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstrata.place.tier import TierStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _StoreCollector:
    """The store's tier counters and pending writes, read when scraped."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        counters = [f.name for f in fields(TierStats) if f.name != "extra"]
        for name in counters:
            fam = CounterMetricFamily(
                f"kvstrata_store_{name}", f"store tier {name} (TierStats.{name})", labels=["tier"])
            for tier_name, tier in self.store.tiers().items():
                fam.add_metric([tier_name], getattr(tier.stats, name))
            yield fam
        yield GaugeMetricFamily(
            "kvstrata_store_pending_writes", "records accepted, not yet written", value=self.store.pending
        )
        yield GaugeMetricFamily(
            "kvstrata_store_retention_ok",
            "1 while the store keeps its retention guarantee (what breaks it: /health)",
            value=0 if self.store.problems() else 1,
        )
        yield GaugeMetricFamily(
            "kvstrata_store_read_only", "1 while the persistent tier takes no writes (why: /health)",
            value=1 if self.store.read_only else 0,
        )
        yield CounterMetricFamily(
            "kvstrata_store_write_failures", "record writes that raised", value=self.store.write_failures
        )
        swa = GaugeMetricFamily(
            "kvstrata_store_memory_bytes", "bytes held by in-process tiers", labels=["tier"]
        )
        swa.add_metric(["swa"], self.store.swa_tier.nbytes())
        swa.add_metric(["memory_global"], self.store.memory_tier.nbytes())
        yield swa


class Metrics:
    def __init__(self, store=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstrata_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.prompts = Counter("kvstrata_prompts", "prompts served, by store outcome", ["kind"], registry=r)
        self.prompt_tokens = Counter("kvstrata_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "kvstrata_cached_tokens", "prompt tokens not run through the model", registry=r
        )
        self.computed_tokens = Counter(
            "kvstrata_computed_tokens", "prompt tokens run through the model", registry=r
        )
        self.generated_tokens = Counter("kvstrata_generated_tokens", "completion tokens", registry=r)
        self.finished = Counter(
            "kvstrata_requests_finished", "generations ended, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvstrata_ttft_seconds", "worker start to first token", ["kind"], buckets=TTFT_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "kvstrata_queue_seconds", "arrival to worker start", buckets=TTFT_BUCKETS, registry=r
        )
        self.waiting = Gauge("kvstrata_requests_waiting", "requests queued for the worker", registry=r)
        self.active = Gauge("kvstrata_requests_active", "requests the worker is running", registry=r)
        if store is not None:
            r.register(_StoreCollector(store))

    def request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def prompt(
        self, kind: str, prompt_tokens: int, cached: int, computed: int, ttft_s: float, queue_s: float
    ) -> None:
        self.prompts.labels(kind).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached)
        self.computed_tokens.inc(computed)
        self.ttft.labels(kind).observe(ttft_s)
        self.queue_wait.observe(queue_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
