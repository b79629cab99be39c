"""`kvstrata serve-bench`'s and `serve-batch-bench`'s settings (no model or server code imported: the CLI
reads its defaults), and `serve-soak`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.settings import DTYPES

#: `serve-bench --peer`: the other servers the same workload runs against ("" for none)
SERVE_PEERS = ("", "llama-server", "vllm")


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
    peer: str = ""  # "llama-server" or "vllm": the same workload against that server too

    def __post_init__(self):
        for name in ("clients", "turns", "conversations", "context", "max_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.duration_s <= 0 or self.probe_swa_ttl_s <= 0 or self.probe_tokens < 0 or self.check < 0:
            raise ValueError("duration_s and probe_swa_ttl_s must be > 0, probe_tokens and check >= 0")
        if self.peer not in SERVE_PEERS:
            raise ValueError(f"unknown serve-bench peer {self.peer!r} (known: {', '.join(SERVE_PEERS[1:])})")


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
    peer: str = ""  # "llama-server": the same levels against llama.cpp's server, `-np` = the streams
    seed: int = 0
    out: str = "docs/results/serve-batching"
    dtype: str = DTYPES[0]  # our servers' weights and activations (`kvstrata serve --dtype`)

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
        if self.peer not in ("", "llama-server"):
            raise ValueError(f"unknown serve-batch-bench peer {self.peer!r} (known: llama-server)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


#: `kvstrata vllm-bench`'s rows: vLLM alone (its own prefix cache), vLLM's example connector (raw
#: tensors on disk), and the kvstrata connector with lossless, NVFP4 and `spec` records
VLLM_CONFIGS = ("vllm", "example", "kvstrata-lossless", "kvstrata-nvfp4", "kvstrata-spec")


@dataclass(frozen=True)
class VllmBenchConfig:
    model: str = "smollm2-135m"
    configs: tuple[str, ...] = VLLM_CONFIGS
    clients: int = 2  # agent conversations, played turn by turn
    turns: int = 6
    context: int = 1024  # tokens of each conversation's document
    tool_tokens: int = 200
    answer_tokens: int = 16
    probe_tokens: int = 4096  # the prompt timed after an engine restart
    tasks: tuple[str, ...] = ("single", "multikey")
    n: int = 10  # retrieval instances per task
    length: int = 2048  # tokens of each retrieval instance
    chunk_tokens: int = 256  # kvstrata records
    #: vLLM's hybrid KV-cache allocator (sliding-window layers hold their window only; the kvstrata
    #: connector keeps their chunks in the store's SWA pool); off: every layer full length, all persistent
    hybrid_allocator: bool = True
    #: the `kvstrata-spec` row's records: SmolLM2's NVFP4-bytes spec from the quality-per-byte work
    spec: str = "int4:keys=channel,group=96,r=0,v=nvfp4,fit=lsq,sink=4,rot=hadamard"
    seed: int = 0
    out: str = "docs/results/vllm"
    work: str = ""  # stores and engine requests (default: a temporary directory, removed after)

    def __post_init__(self):
        unknown = set(self.configs) - set(VLLM_CONFIGS)
        if unknown or not self.configs:
            raise ValueError(f"configs must be among {', '.join(VLLM_CONFIGS)}, got "
                             f"{', '.join(self.configs)}")
        for name in ("clients", "turns", "context", "answer_tokens", "probe_tokens", "n", "length",
                     "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_tokens % 32:
            raise ValueError(f"chunk_tokens must be a multiple of vLLM's block size 32, got "
                             f"{self.chunk_tokens}")


@dataclass(frozen=True)
class SoakConfig:
    load: ServeBenchConfig = field(default_factory=lambda: ServeBenchConfig(
        model="smollm2-135m", method="bf16", context=1024, duration_s=1800.0, check=40, probe_tokens=0))
    master_kill_at: float = 0.2  # share of the duration
    server_kill_at: float = 0.45
    fill_at: float = 0.7
    fill_for: float = 0.1
    retries: int = 3  # a turn failed by the server's restart is asked again
    request_timeout_s: float = 600.0  # a request past it is a hang
    rss_bound: float = 0.5  # allowed RSS growth over the warm level (share)
    server_args: tuple[str, ...] = ()  # e.g. ("--replay-tokens", "64") for cold-identical replays

    def __post_init__(self):
        for name in ("master_kill_at", "server_kill_at", "fill_at"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if not 0 < self.fill_for < 1 - self.fill_at:
            raise ValueError("fill_for must be > 0 and end before the run does")
