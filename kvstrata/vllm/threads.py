"""The threads the connector encodes and decodes on: one worker each, running one OpenMP thread.

vLLM's CPU backend pins its forward's OpenMP team to cores. A record's encode or decode is thousands
of small torch ops; on that team each forks over the pinned threads and waits for the slowest, and
on a machine whose cores are busy that costs many times the work. Measured (SmolLM2-135M, NVFP4,
2,048-token prompt, the machine under other load): decoding one 256-token chunk of 30 layers took
12.9 s on the forward's thread and 0.54 s on one of these; a restarted engine's hits took 24.9 / 21.3
/ 15.0 s, then 2.6 / 2.0 / 2.9 s. A writer thread on OpenMP's default team (as wide as the machine)
spun on the forward's cores instead: a 6-turn conversation took 7.8 s instead of 4.5. OpenMP's
thread count is per thread, so this leaves the forward's alone (vLLM replaces
`torch.set_num_threads`, which would also set MKL's process-wide count).
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
