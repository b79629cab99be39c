"""The lab's run settings as plain dataclasses (no model code imported): the benchmark's
`BenchConfig` and the tuner's `TuneConfig`, with their defaults -- the CLI builds its flags' defaults
from these fields -- and the checks that need no model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvstrata.methods import parse_method, render_recipe
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

    def check(self) -> None:
        if len(self.ladder) < 2:
            raise ValueError("the ladder needs at least two recipes (best first)")
        for rung in self.ladder:
            if ";" in rung:
                raise ValueError(f"ladder rung {rung!r}: one recipe per rung (no ';')")
            parse_method(f"layers[0]={rung}")  # a rung must be assignable to one layer
            if self.kv_apart:
                _check_kv_rung(rung)
        if self.kv_apart:  # every pairing of a keys rung with a values rung must be one recipe
            for k_rung in self.ladder:
                for v_rung in self.ladder:
                    try:
                        kv_recipe(k_rung, v_rung)
                    except ValueError as e:
                        raise ValueError(f"ladder rungs {k_rung!r} (keys) and {v_rung!r} (values) do "
                                         f"not make one recipe: {e}") from None
        if set(self.calib) & set(self.heldout):
            raise ValueError(f"calibration instances {sorted(set(self.calib) & set(self.heldout))} are also "
                             "held out: they must be disjoint")
        if self.layer_keep not in ("uniform", "mass"):
            raise ValueError(f"--layer-keep must be uniform or mass, got {self.layer_keep!r}")
        if not self.calib or not self.heldout:
            raise ValueError("tuning needs calibration and held-out instances")
        for t in self.tasks:
            if t == "report":
                raise ValueError("tune chooses on calibration families only: the report families are what "
                                 "its choice is measured on afterwards (use calib)")
            if t not in TUNE_TASKS:
                raise ValueError(f"tune scores retrieval tasks ({', '.join(TUNE_TASKS)}); got {t!r}")

    def key(self) -> dict:
        """What measurements depend on: a state file written under other settings is refused."""
        return {k: v for k, v in asdict(self).items() if k in ("model", "length", "seed", "haystack")}


def _check_kv_rung(rung: str) -> None:
    """With keys apart from values, a rung must be one store codec whose values half `v=` can name."""
    rec = parse_method(rung).full
    if rec.keep is not None or rec.vcodec is not None:
        raise ValueError(f"ladder rung {rung!r}: with keys apart from values a rung is one store codec "
                         "(no keep policy or v=)")
    try:
        kv_recipe(REFERENCE, rung)
    except ValueError as e:
        raise ValueError(f"ladder rung {rung!r}: with keys apart from values its codec must be one v= "
                         f"can name: {e}") from None


def kv_recipe(k_rung: str, v_rung: str) -> str:
    """One layer's recipe with keys as on `k_rung` and values as on `v_rung`: the keys' recipe with
    the values' codec, the larger full-precision tail and sink, and the transforms that act on
    values too (rotation) when either has them; `r` and `keys` always written. Equal rungs: the rung
    as given."""
    if k_rung == v_rung:
        return k_rung
    rk, rv = parse_method(k_rung).full, parse_method(v_rung).full
    both = [t for t in rv.transforms if t.acts_on_values and rk.transform(type(t)) is None]
    rec = replace(rk, r=max(rk.r, rv.r), sink=max(rk.sink, rv.sink), vcodec=rv.value_codec,
                  transforms=tuple(sorted(rk.transforms + tuple(both), key=lambda t: t.order)))
    return render_recipe(rec, explicit=("r", "keys"))


