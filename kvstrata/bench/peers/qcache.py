"""Peer: transformers' `QuantizedCache` (quanto / HQQ backends), fed the benchmark's own prefill.

The cell's dense prefill is handed to the cache through `Cache.update`, exactly the call the model
makes at the end of a prefill; the question is then asked through the same greedy loop as ours.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

import torch

from kvstrata.bench import protocol
from kvstrata.bench.peers import PeerSpec
from kvstrata.bench.peers.held import held_bytes
from kvstrata.hf.run import forward


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
    from transformers import QuantizedCache

    cache = QuantizedCache(peer.name, model.config, nbits=peer.params["bits"])
    for i, layer in enumerate(pre.dense.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), i)
    return cache


def ask(model, tokenizer, pre: protocol.Prefill, peer: PeerSpec, question) -> dict:
    t0 = time.perf_counter()
    cache = build(model, pre, peer)
    compress_s = time.perf_counter() - t0
    held = held_bytes(cache)
    res = protocol.greedy(model, tokenizer, cache, question, lambda: held_bytes(cache)["bytes"])
    dense_read = res.pop("dense_read") or held["bytes"]
    return {**res, "kv_bytes": held["bytes"], "kv_bytes_in_memory": held["in_memory"], "compress_s": compress_s,
            "bytes_read_per_step": dense_read, "dense_bytes_read_per_step": dense_read}


def fidelity(model, pre: protocol.Prefill, peer: PeerSpec, cont_ids: torch.Tensor, ref: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    cache = build(model, pre, peer)
    compress_s = time.perf_counter() - t0
    held = held_bytes(cache)
    t0 = time.perf_counter()
    got = forward(model, cont_ids, cache, logits_to_keep=cont_ids.shape[1])[0]
    return {**protocol.fidelity_scores(ref, got, cont_ids), "kv_bytes": held["bytes"],
            "kv_bytes_in_memory": held["in_memory"], "compress_s": compress_s,
            "question_s": time.perf_counter() - t0, "decode_s_per_token": None, "bytes_read_per_step": held["bytes"]}
