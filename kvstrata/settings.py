"""Settings with no heavy imports, so the CLI's parsers read their defaults without loading torch:
the generation entry point's (`kvstrata.hf.run.generate`, `kvstrata generate`), the replay length
(`kvstrata.place.prefix_server`), the server scheduler's limits (`kvstrata.serve.scheduler`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EXACT = "exact"
ReplayTokens = int | Literal["exact"] | None  # how many tokens a replay reruns (None: 2 sliding windows)


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 32
    #: prompt tokens prefilled per forward pass: bounds the prefill's transient full-precision K/V and
    #: attention workspace, which otherwise outweigh a compressed cache at long contexts (None: one pass)
    prefill_chunk: int | None = 256
    #: the store's block size (tokens): a prompt is also cut at the last multiple of it before its last
    #: token, where `kvstrata serve` cuts it to store its blocks -- so both encode a prompt alike
    #: (None: no store, no such cut)
    store_block: int | None = 256


@dataclass(frozen=True)
class Limits:
    """What one step of `kvstrata serve`'s model worker may run (`kvstrata.serve.scheduler`)."""

    max_running: int = 16  # requests in the batch at once
    max_queue: int = 16  # requests waiting beyond those; one more is answered 429
    max_batched_tokens: int = 512  # tokens per forward (decode rows count one each)
    prefill_chunk: int = GenerateConfig.prefill_chunk  # most tokens of one prompt per step (as `generate`)
    kv_budget_bytes: int = 0  # bytes of KV the running requests may hold at their longest; 0: no limit
    batching: bool = True  # False: one request's row per forward (the unbatched worker)

    def __post_init__(self):
        checks = [
            (self.max_running >= 1, f"max_running must be >= 1, got {self.max_running}"),
            (self.max_queue >= 0, f"max_queue must be >= 0, got {self.max_queue}"),
            (self.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {self.prefill_chunk}"),
            (self.max_batched_tokens >= self.prefill_chunk,
             f"max_batched_tokens ({self.max_batched_tokens}) must be >= prefill_chunk "
             f"({self.prefill_chunk})"),
            (self.kv_budget_bytes >= 0, f"kv_budget_bytes must be >= 0, got {self.kv_budget_bytes}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


#: the model's weights and activations: `float32` (the reference) or `bf16` (half the weight bytes; fast
#: where the CPU has AVX512-BF16 or AMX); a result row records which
DTYPES = ("float32", "bf16")
