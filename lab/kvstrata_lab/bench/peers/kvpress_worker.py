"""Runs kvpress presses on benchmark cells inside the peers environment; one JSON row per line.

`python -m kvstrata_lab.bench.peers.kvpress_worker REQUEST.json` (written by `kvstrata bench --peers`).
Each press compresses during the context's prefill (kvpress's own forward hooks, as its pipeline
does), then the question is fed at the context's true positions and decoded with our greedy loop.
Rows go to stdout as JSON lines; everything else the libraries print goes to stderr.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from kvstrata.hf.run import forward
from kvstrata.models import load
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.cells import answered, cell_base, costed, failed
from kvstrata_lab.bench.peers import PRESSES, PeerSpec, parse_peer
from kvstrata_lab.bench.peers.held import held_bytes
from kvstrata_lab.bench.tasks import FIDELITY, make_instance


def describe() -> str:
    return f"kvpress {version('kvpress')} (transformers {version('transformers')})"


def make_press(peer: PeerSpec):
    """The kvpress object for a parsed spec (head-wise presses wrapped as kvpress documents)."""
    import kvpress  # only installed in the peers environment

    cr = peer.params["cr"]
    if peer.name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=cr))
    return getattr(kvpress, PRESSES[peer.name])(compression_ratio=cr)


def masked_entries(model) -> int:
    """Entries a head-wise press masks at attention time but still keeps in memory."""
    total = 0
    for module in model.modules():
        idx = getattr(module, "masked_key_indices", None)
        if idx is not None:
            total += len(idx[0])
    return total


def pressed_prefill(model, ids: torch.Tensor, peer: PeerSpec):
    """(cache, seconds): the context prefilled under the press, as kvpress's pipeline does it."""

    cache = DynamicCache(config=model.config)
    press = make_press(peer)
    t0 = time.perf_counter()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache, time.perf_counter() - t0


def run_cell(model, tok, model_name: str, cell: dict, seed: int, haystack: str, dtype: str = "float32"):
    """Yield one row per press of the cell as soon as it is done (`dtype`: the model's, recorded)."""
    inst = make_instance(cell["task"], tok, cell["length"], cell["index"], seed, haystack)
    ids = tok(inst.context, return_tensors="pt").input_ids
    n = ids.shape[1]
    cont = ref = None
    if inst.task in FIDELITY:

        cont = tok(inst.continuation, add_special_tokens=False, return_tensors="pt").input_ids
        dense = DynamicCache(config=model.config)
        forward(model, ids, dense)
        ref = forward(model, cont, dense, logits_to_keep=cont.shape[1])[0]
    for method in cell["methods"]:
        peer = parse_peer(method)
        row = dict(cell_base(model, model_name, cell["length"], inst, n, None), dtype=dtype, method=method,
                   family="peer", peer=describe())
        try:
            cache, seconds = pressed_prefill(model, ids, peer)
            held = held_bytes(cache)
            row.update(prefill_s=seconds, compress_s=None, kv_bytes_in_memory=held["in_memory"],
                       kv_entries_held=held["entries"], kv_entries_masked=masked_entries(model))
            if cont is not None:
                pos = torch.arange(n, n + cont.shape[1])[None]
                res = protocol.continuation(model, copy.deepcopy(cache), cont, ref,
                                            held["bytes"], None, position_ids=pos)
                row.update(res, score=res["top1"], failure=None)
            else:
                answers = []
                for q in inst.questions:
                    c = copy.deepcopy(cache)  # each question starts from the pressed context
                    res = protocol.greedy(model, tok, c, q, lambda c=c: held_bytes(c)["bytes"], position=n)
                    answers.append(protocol.with_costs(res, held["bytes"], None))
                answered(row, inst, answers)
            yield costed(row, n)
        except Exception as exc:  # the peer's own failure on this model is a result, reported
            yield failed(row, exc)


def main(argv: list[str] | None = None) -> int:

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvstrata_lab.bench.peers.kvpress_worker REQUEST.json", file=sys.stderr)
        return 2
    req = json.loads(Path(args[0]).read_text())
    out, sys.stdout = sys.stdout, sys.stderr  # libraries' prints must not mix with rows

    hf_logging.disable_progress_bar()
    dtype = req.get("dtype", "float32")  # the bench's --dtype: peers run the model as our rows do
    model, tok = load(req["model_path"], dtype)
    for cell in req["cells"]:
        for row in run_cell(model, tok, req["model"], cell, req["seed"], req["haystack"], dtype):
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
