"""The lab's run settings as plain dataclasses (no model or method code imported: the CLI reads its
flags' defaults from these fields without loading torch): the benchmark's `BenchConfig`, the tuner's
`TuneConfig` (its checks, which parse recipes, are `kvstrata_lab.bench.tune.check_config`) and
`kvstrata sparse-recall`'s `RecallConfig`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstrata_lab.bench.tasks import RETRIEVAL, TASKS

#: the stock rows, transformers' own caches and attention (no kvstrata code on the path):
#: `dynamic` (DynamicCache, concatenates each step) and `static` (StaticCache, preallocated)
STOCK = ("dynamic", "static")

DEFAULT_METHODS = (
    "dynamic", "bf16", "fp8", "int4:r=32", "int2:r=32", "mxfp4", "nvfp4",
    "streaming:keep=0.53", "streaming:keep=0.28", "snapkv:keep=0.53", "snapkv:keep=0.28", "snapkv:keep=0.19",
)
QUICK = dict(
    models=("smollm2-135m",), lengths=(2048,), n=2,
    methods=(
        "dynamic", "bf16", "fp8", "int2:r=32", "mxfp4", "nvfp4", "streaming:keep=0.28", "snapkv:keep=0.28",
    ),
)


@dataclass
class BenchConfig:
    models: tuple[str, ...] = ("smollm2-135m",)
    lengths: tuple[int, ...] = (2048,)
    tasks: tuple[str, ...] = TASKS
    methods: tuple[str, ...] = DEFAULT_METHODS
    n: int = 20
    seed: int = 0
    haystack: str = "noise"
    out: Path = field(default_factory=lambda: Path("runs/bench"))
    #: explicit (model, length) pairs; default: every model at every length
    pairs: tuple[tuple[str, int], ...] = ()
    #: peer specs (`kvpress:…`, `qcache:…`) run on the same instances; see kvstrata_lab.bench.peers
    peers: tuple[str, ...] = ()
    #: the model's weights and activations (`kvstrata.settings.DTYPES`); every row records it
    dtype: str = "float32"

    def plan(self) -> tuple[tuple[str, int], ...]:
        return self.pairs or tuple((m, L) for m in self.models for L in self.lengths)



DEFAULT_LADDER = ("bf16", "fp8", "nvfp4:rot=hadamard", "int2:r=32,rot=hadamard")
REFERENCE = "bf16"
#: what the tuner may choose on: RULER's retrieval tasks and the calibration families, never `report`
TUNE_TASKS = RETRIEVAL + ("calib",)


@dataclass
class TuneConfig:
    model: str
    length: int
    ladder: tuple[str, ...] = DEFAULT_LADDER  # recipes, best first
    tasks: tuple[str, ...] = RETRIEVAL
    calib: tuple[int, ...] = (100, 101)
    heldout: tuple[int, ...] = (0, 1, 2, 3)
    max_drop: float = 0.01  # retrieval points (0-1) the chosen spec may lose against bf16
    top1: float = 0.97  # floor on top-1 agreement with the uncompressed cache
    bytes: float | None = None  # optional target, stored bytes per token
    seed: int = 0
    haystack: str = "noise"
    kv_apart: bool = False  # keys and values of a layer on rungs of their own
    layer_keep: str = "uniform"  # with --keep: one fraction for all layers, or split by attention mass
    out: Path = field(default_factory=lambda: Path("runs/tune"))

    def key(self) -> dict:
        """What measurements depend on: a state file written under other settings is refused."""
        return {k: v for k, v in asdict(self).items() if k in ("model", "length", "seed", "haystack")}


#: `kvstrata sparse-recall`'s read: a top-k selection over the bf16 store
DEFAULT_METHOD = "topk:k=512,schedule=F1,indexer=lowrank,rank=16"


@dataclass(frozen=True)
class RecallConfig:
    model: str = "gemma3-270m"
    method: str = DEFAULT_METHOD
    lengths: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    prompts: int = 2  # instances per length (indices 0..prompts-1)
    task: str = "single"
    chunk: int = 2048  # prefill tokens per forward pass
    seed: int = 0
    haystack: str = "noise"
    threads: int = 2


# `kvstrata retrofit` / `retrofit-eval` (kvstrata_lab.bench.retrofit)
@dataclass(frozen=True)
class RetrofitConfig:
    model: str
    out: Path
    split: int | None = None  # first decoder layer (None: half the depth)
    n_win: int = 128  # positions the decoder runs over (its own K/V window)
    length: int = 2048  # tokens per calibration text
    texts: int = 24  # calibration texts fitted on
    heldout: int = 2  # calibration texts the errors are measured on (never fitted on)
    ridge: float = 1e-4  # of the normal equations' mean diagonal
    distill_minutes: float = 10.0  # then distil the projections against the original's logits (0: skip)
    lr: float = 1e-3  # the distillation's Adam step
    dtype: str = "float32"
    seed: int = 0
    store: str = "projected"  # what the persistent store keeps of the decoder half: "projected" | "hidden"


@dataclass(frozen=True)
class EvalConfig:
    model: str  # the original
    ced: Path  # its encoder-decoder directory
    out: Path
    length: int = 4096
    tasks: tuple[str, ...] = ("report",)
    n: int = 100
    timing: tuple[int, ...] = (2048, 4096, 8192)
    repeats: int = 3
    dtype: str = "float32"
    seed: int = 0
    store_method: str = "nvfp4"  # the store's evidence (both ways of keeping the decoder half) at this method
