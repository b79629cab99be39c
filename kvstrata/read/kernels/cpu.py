"""Build and load the C++ decode-attention kernel (`decode_attention.cpp`) on first use.

Built with torch's `cpp_extension` for this machine (`-O3 -march=native`, OpenMP through torch's own
runtime) into `$KVSTRATA_CACHE/kernels/<hash>`, keyed by the source, torch's version and the CPU,
so a rebuild happens only when one of them changes. If the build fails, callers fall back to the
reference path and a one-line warning says why. `KVSTRATA_KERNELS=reference` skips it. Processes
take turns on the build directory through an OS file lock, which dies with its holder: torch's own
lock file outlives a process killed mid-build and would make every later one wait forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_state: dict = {}


def _cache_root() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE", Path.home() / ".cache" / "kvstrata")) / "kernels"


def _cpu_id() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def build_key() -> str:
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(), torch.__version__.encode(), " ".join(FLAGS).encode(), _cpu_id().encode(),
    ):
        h.update(part)
    return h.hexdigest()[:16]


def load(verbose: bool = False):
    """The compiled module, or None (reference path) when disabled or the build failed."""
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("KVSTRATA_KERNELS", "auto") != "reference":
        from torch.utils import (
            cpp_extension,  # the compiler toolchain helpers, loaded only when the kernel is built
        )

        key = build_key()
        build_dir = _cache_root() / key
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(build_dir / "build.flock", "w") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX)
                (build_dir / "lock").unlink(missing_ok=True)  # torch's: left by a holder that died
                module = cpp_extension.load(
                    name=f"kvstrata_decode_{key}", sources=[str(SOURCE)], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=verbose,
                )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference path
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = next((line for line in lines if "error" in line.lower()), lines[0])
            warnings.warn(
                f"kvstrata: C++ decode kernel unavailable ({first[:200]}); using the reference path",
                RuntimeWarning, stacklevel=2,
            )
    _state["module"] = module
    return module
