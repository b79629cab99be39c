"""Build and load the C++ decode-attention kernel (`decode_attention.cpp`) on first use.

Built with torch's `cpp_extension` for this machine (`-O3 -march=native`, OpenMP through torch's own
runtime) into `$KVSTRATA_CACHE/kernels/<hash>`, keyed by the sources, torch's version, the flags and
the CPU, so a rebuild happens only when one of them changes. The decode path is the best this CPU
has (AVX-512, else AVX2, else scalar); `KVSTRATA_KERNEL_ISA=avx2|scalar` builds a lower one (tests
check every path the machine can run against the reference), `=buffered` the best one with every tile
decoded into a float buffer (the reference the in-register reads are tested against, bit for bit).
`KVSTRATA_KERNEL_SCORES=int8` scores NVFP4 / MXFP4 keys in the codes' integer domain (`int8.h`: the
query rounded to int8 per 16 values, AVX-512 VNNI), which moves scores by the query's rounding; the
default `float` scores them as the reference does. If the build fails, callers fall back to the
reference path and a one-line warning says why.
`KVSTRATA_KERNELS=reference` skips it. Processes take turns on the build directory through an OS file
lock, which dies with its holder: torch's own lock file outlives a process killed mid-build and would
make every later one wait forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

from kvstrata.codecs import nvfp4

SOURCE = Path(__file__).with_name("decode_attention.cpp")
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("codes.h", "encode.h", "fused.h", "int8.h", "linalg.h", "linear.h", "topk.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
# the instruction sets a build can be held to (GCC drops every extension built on the one removed)
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx"],
             # the best path, but every tile decoded into a float buffer first (the fused reads' reference)
             "buffered": ["-DKV_BUFFERED"]}
_state: dict = {}


def env_choice(name: str, choices, default: str) -> str:
    """Environment variable `name` (default `default`), checked against `choices`: one clear error."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def chosen_isa() -> str:
    """`KVSTRATA_KERNEL_ISA` (default `native`: the best this CPU has), checked."""
    return env_choice("KVSTRATA_KERNEL_ISA", ISA_FLAGS, "native")


SCORES = ("float", "int8")


def chosen_scores() -> str:
    """`KVSTRATA_KERNEL_SCORES` (default `float`), checked; the kernel reads it on every call."""
    return env_choice("KVSTRATA_KERNEL_SCORES", SCORES, "float")


def flags(isa: str = "native") -> list[str]:
    return FLAGS + ISA_FLAGS[isa]


def _cache_root() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE", Path.home() / ".cache" / "kvstrata")) / "kernels"


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def runnable_isas() -> list[str]:
    """The instruction sets a build for this CPU can be held to, best first (each one it can run)."""
    flags = set(_cpu_id().split())
    return ["native"] + (["avx2"] if {"avx2", "fma"} <= flags else []) + ["scalar"]


def expected_isa(isa: str = "native") -> str:
    """The decode path a build for `isa` on this CPU takes (what the module's `isa()` reports)."""
    flags = set(_cpu_id().split())
    if isa in ("native", "buffered") and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if isa != "scalar" and {"avx2", "fma"} <= flags else "scalar"


def build_key(isa: str = "native") -> str:
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(), *(p.read_bytes() for p in HEADERS), torch.__version__.encode(),
        " ".join(flags(isa)).encode(), _cpu_id().encode(),
    ):
        h.update(part)
    return h.hexdigest()[:16]


def load(verbose: bool = False, isa: str | None = None):
    """The compiled module (built for `isa`, default `chosen_isa()`), or None (reference path) when
    disabled or the build failed."""
    isa = isa or chosen_isa()
    chosen_scores()
    if isa in _state:
        return _state[isa]
    module = None
    if os.environ.get("KVSTRATA_KERNELS", "auto") != "reference":
        from torch.utils import (
            cpp_extension,  # the compiler toolchain helpers, loaded only when the kernel is built
        )

        key = build_key(isa)
        build_dir = _cache_root() / key
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(build_dir / "build.flock", "w") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX)
                (build_dir / "lock").unlink(missing_ok=True)  # torch's: left by a holder that died
                module = cpp_extension.load(
                    name=f"kvstrata_decode_{key}", sources=[str(SOURCE)], extra_cflags=flags(isa),
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose,
                )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference path
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = next((line for line in lines if "error" in line.lower()), lines[0])
            warnings.warn(
                f"kvstrata: C++ decode kernel unavailable ({first[:200]}); using the reference path",
                RuntimeWarning, stacklevel=2,
            )
    _state[isa] = module
    return module


nvfp4.use_native(load)  # NVFP4 encodes through this build's `encode_nvfp4` (the same codes as PyTorch's)
