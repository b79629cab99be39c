"""Defaults of the library's generation entry point, as a config dataclass with no heavy imports:
`kvstrata.hf.run.generate` and `kvstrata generate`'s flags both read it."""

from __future__ import annotations

from dataclasses import dataclass


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
