"""The thread the connector encodes and writes on: one worker, running one OpenMP thread.

A new thread starts with OpenMP's default team (as wide as the machine), whose spinning workers share
the cores vLLM's CPU backend pins its forward to: measured, a 6-turn conversation took 7.8 s instead
of 4.5. OpenMP's thread count is per thread, so this leaves the forward's alone (vLLM replaces
`torch.set_num_threads`, which would also set MKL's process-wide count). Loads stay on the forward's
thread and team: measured back to back (SmolLM2-135M, NVFP4, 2,048-token prompt, hits after a
restart), decoding them on a one-OpenMP-thread loader made hits 0.7-1.9 s against 0.4-1.0 s.
"""

from __future__ import annotations

import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("vllm.kvstrata.connector")


def one_openmp_thread(name: str) -> ThreadPoolExecutor:
    """A one-worker pool named `name` whose thread runs torch with one OpenMP thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_one_openmp_thread)


def _one_openmp_thread() -> None:
    """This thread's OpenMP team: one thread (without torch's bundled libgomp, nothing is changed)."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if lib.exists():
        ctypes.CDLL(str(lib)).omp_set_num_threads(1)
    else:
        log.info("kvstrata: no libgomp beside torch (%s): this thread keeps OpenMP's default", lib)
