"""Server settings: one dataclass, validated once; the store's own settings stay in `StoreConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.names import Retention
from kvstrata.settings import DTYPES, EXACT, Limits, ReplayTokens

RETENTIONS = tuple(r.value for r in Retention)


@dataclass(frozen=True)
class ServeConfig:
    """What `kvstrata serve` runs: the model, the method its KV is stored with, and the limits that
    keep one process serving under any load (bounded queue, per-request deadline, body size)."""

    model: str
    method: str = "bf16"
    served_model_name: str = ""  # the `model` clients name; default: `model` as given
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str = ""  # one key per line; when set, /v1/* needs `Authorization: Bearer <key>`
    store_config: str = ""  # TOML with a [store] table (KVSTRATA_STORE_* env vars apply too)
    use_store: bool = True  # False: every request a full prefill, nothing written (the baseline)
    max_running: int = Limits.max_running  # requests in the worker's batch at once
    max_queue: int = Limits.max_queue  # requests waiting beyond those; one more is answered 429
    max_batched_tokens: int = Limits.max_batched_tokens  # tokens per batched forward
    prefill_chunk: int = Limits.prefill_chunk  # most tokens of one prompt per step
    kv_budget_mb: float = 0.0  # KV the running requests may hold at their longest (MiB); 0: no limit
    batching: bool = True  # False: one request per forward (the unbatched worker, for comparison)
    request_timeout_s: float = 300.0  # deadline per request, from its arrival
    default_max_tokens: int = 256  # when a request names none (capped by the context left)
    # tokens replayed on an SWA miss: a count, "exact" (the receptive field of the sliding windows:
    # answers equal a cold run's) or None (2 sliding windows: bounded, approximate)
    replay_tokens: ReplayTokens = None
    default_retention: str = "24h"  # retention class of requests that name none
    memory_global_gb: float = 1.0  # RAM for global KV of `prompt_cache_retention: "in_memory"` requests
    max_body_bytes: int = 8 << 20
    log_level: str = "warning"
    dtype: str = DTYPES[0]  # the model's weights and activations (`kvstrata.settings.DTYPES`)

    def __post_init__(self):
        checks = [
            (1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}"),
            (self.kv_budget_mb >= 0, f"kv_budget_mb must be >= 0, got {self.kv_budget_mb}"),
            (self.request_timeout_s > 0, f"request_timeout_s must be > 0, got {self.request_timeout_s}"),
            (self.default_max_tokens >= 1, f"default_max_tokens must be >= 1, got {self.default_max_tokens}"),
            (self.replay_tokens in (None, EXACT) or (isinstance(self.replay_tokens, int)
                                                     and self.replay_tokens >= 0),
             f"replay_tokens must be a count >= 0 or {EXACT!r}, got {self.replay_tokens!r}"),
            (self.default_retention in RETENTIONS, f"default_retention must be one of {RETENTIONS}, got "
                                                   f"{self.default_retention!r}"),
            (self.memory_global_gb > 0, f"memory_global_gb must be > 0, got {self.memory_global_gb}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.limits  # noqa: B018 - checks the scheduler's settings too

    @property
    def limits(self) -> Limits:
        return Limits(max_running=self.max_running, max_queue=self.max_queue,
                      max_batched_tokens=self.max_batched_tokens, prefill_chunk=self.prefill_chunk,
                      kv_budget_bytes=int(self.kv_budget_mb * 2**20), batching=self.batching)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
