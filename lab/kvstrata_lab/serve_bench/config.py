"""`kvstrata serve-bench`'s and `serve-batch-bench`'s settings (no model or server code imported: the CLI
reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "gemma3-270m"
    method: str = "bf16"
    clients: int = 8
    turns: int = 12
    conversations: int = 1  # per client
    context: int = 2048  # tokens of each conversation's document
    tool_tokens: int = 200
    max_tokens: int = 16
    duration_s: float = 1800.0  # per load phase
    probe_tokens: int = 8192  # 0: no probe
    probe_warm_turns: int = 5
    probe_swa_ttl_s: float = 30.0
    check: int = 8
    block_size: int = 256
    seed: int = 0
    out: str = "docs/results/serve"

    def __post_init__(self):
        for name in ("clients", "turns", "conversations", "context", "max_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.duration_s <= 0 or self.probe_swa_ttl_s <= 0 or self.probe_tokens < 0 or self.check < 0:
            raise ValueError("duration_s and probe_swa_ttl_s must be > 0, probe_tokens and check >= 0")


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str = "smollm2-135m"
    methods: tuple[str, ...] = ("bf16", "nvfp4")
    streams: tuple[int, ...] = (1, 4, 8, 16)
    requests: int = 2  # per stream and level, and at least `level_requests` per level in all
    level_requests: int = 8  # so a level of few streams is not timed on one or two requests
    prompt_tokens: int = 128
    max_tokens: int = 32
    probe_tokens: int = 1024
    probe_streams: int = 8
    budget_sequences: int = 4  # the KV budget holds this many bf16 sequences at their longest
    budget_streams: int = 16
    seed: int = 0
    out: str = "docs/results/serve-batching"

    def __post_init__(self):
        for name in (
            "requests",
            "prompt_tokens",
            "max_tokens",
            "probe_streams",
            "budget_sequences",
            "budget_streams",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.streams or min(self.streams) < 1 or not self.methods:
            raise ValueError("streams must be counts >= 1 and methods non-empty")
