"""Peer: transformers' `QuantizedCache` (quanto / HQQ backends), fed the benchmark's own prefill.

The cell's dense prefill is handed to the cache through `Cache.update`, exactly the call the model
makes at the end of a prefill; the question is then asked through the same greedy loop as ours.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

import torch
from transformers import QuantizedCache

from kvstrata.hf.attention import stock_attention
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.peers import PeerSpec
from kvstrata_lab.bench.peers.held import held_bytes


def describe(peer: PeerSpec) -> str:
    """`transformers X QuantizedCache(backend Y)`: the versions a row was produced with."""
    package = {"quanto": "optimum-quanto", "hqq": "hqq"}[peer.name]
    try:
        backend = version(package)
    except PackageNotFoundError:
        backend = "not installed"
    return f"transformers {version('transformers')} QuantizedCache({package} {backend})"


def build(model, pre: protocol.Prefill, peer: PeerSpec):
    """A QuantizedCache holding the prefilled context; raises the peer's own error if it cannot."""

    cache = QuantizedCache(peer.name, model.config, nbits=peer.params["bits"])
    for i, layer in enumerate(pre.dense.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    return cache


def ask(model, tokenizer, pre: protocol.Prefill, peer: PeerSpec, question) -> dict:
    cache, compress_s, held = _timed_build(model, pre, peer)
    with stock_attention(model.config):  # the peer as users run it: no kvstrata code on the path
        res = protocol.greedy(model, tokenizer, cache, question, lambda: held_bytes(cache)["bytes"])
    return protocol.with_costs(res, held["bytes"], compress_s, kv_bytes_in_memory=held["in_memory"])


def fidelity(model, pre: protocol.Prefill, peer: PeerSpec, cont_ids: torch.Tensor, ref: torch.Tensor) -> dict:
    cache, compress_s, held = _timed_build(model, pre, peer)
    with stock_attention(model.config):
        return protocol.continuation(model, cache, cont_ids, ref, held["bytes"], compress_s,
                                     kv_bytes_in_memory=held["in_memory"])


def _timed_build(model, pre: protocol.Prefill, peer: PeerSpec):
    """(cache, seconds to build it, what it holds)."""
    t0 = time.perf_counter()
    cache = build(model, pre, peer)
    return cache, time.perf_counter() - t0, held_bytes(cache)
