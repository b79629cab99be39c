"""The lab's `kvstrata` subcommands, added to the library's parser through the entry point
`kvstrata.commands` (`lab/pyproject.toml`): the benchmark and its report, the tuner, the passkey
check, and the evidence commands behind docs/results. Each module registers its own parsers."""

from __future__ import annotations

from kvstrata_lab.cli import (
    bench,
    evidence,
    passkey,
    retrofit,
    serve_batch,
    serve_bench,
    soak,
    sparse_recall,
    tune,
    vllm_bench,
)

MODULES = (passkey, bench, tune, evidence, sparse_recall, serve_bench, serve_batch, soak, vllm_bench,
           retrofit)


def register(sub) -> None:
    for module in MODULES:
        module.register(sub)
