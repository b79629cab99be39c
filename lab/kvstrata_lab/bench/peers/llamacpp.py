"""llama.cpp's quantized KV cache on the benchmark's exact instances: `llamacpp:<type>` rows.

One `llama-server` per KV type, all started at once for a model, so every cell is asked of every
type in turn (paired in time as in instances). The context's token ids are sent as ids (no text,
no BOS added: our tokenizer's ids, as our rows feed them), prefilled once per cell and kept in the
slot's cache; each question is sent as context + question ids and decoded greedily for the
question's token budget; the answer is cut where our greedy loop stops (EOS, a newline or a full
stop once something was said) and scored by our scorer. Bytes per token count llama.cpp's block
layout over the tokens a cache of our own accounting holds (sliding layers: their window).
Fidelity tasks need logits over a teacher-forced continuation, which llama-server does not give:
those rows carry that as their error.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from kvstrata.hf.run import bf16_bytes_per_token
from kvstrata.models.loader import load_config, load_tokenizer
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.cells import answered, cell_base, costed, failed
from kvstrata_lab.bench.peers import LLAMACPP_TYPES, PeerSpec, parse_peer
from kvstrata_lab.bench.peers.llamacpp_build import ensure, version
from kvstrata_lab.bench.peers.llamacpp_gguf import gguf_for, weights
from kvstrata_lab.bench.peers.llamacpp_server import LlamaServer
from kvstrata_lab.bench.tasks import FIDELITY, make_instance


def bytes_per_token(peer: PeerSpec, config, tokens: int) -> float:
    """K and V each half of bf16's bytes, at their type's bytes per value instead of 2."""
    bf16 = bf16_bytes_per_token(config, tokens)
    return bf16 / 2 * (LLAMACPP_TYPES[peer.name] / 64 + LLAMACPP_TYPES[peer.params["v"]] / 64)


def server_args(peer: PeerSpec, context: int) -> list[str]:
    return ["-c", str(context), "-np", "1", "--cache-type-k", peer.name, "--cache-type-v", peer.params["v"],
            "-b", "2048", "-ub", "512"]


def answer(tok, ids: list[int], question, server: LlamaServer) -> dict:
    """One question after the context, as `protocol.greedy` answers it."""
    q_ids = tok(question.text, add_special_tokens=False).input_ids
    res = server.complete(ids + q_ids, question.max_new_tokens)
    new: list[int] = []
    for t in res["tokens"]:
        new.append(t)
        if protocol.answer_done(tok, new):
            break
    tm = res["timings"]
    return {"output": tok.decode(new, skip_special_tokens=True), "question_s": tm["prompt_ms"] / 1e3,
            "decode_s_per_token": tm["predicted_per_token_ms"] / 1e3 if tm.get("predicted_n", 0) > 1
            else None}


def run_cell(tok, config, model_name: str, cell: tuple, servers: dict, describe: str, cfg) -> list[dict]:
    """One row per llama.cpp type; `servers` maps each to (spec, server) or (spec, why it did not start)."""
    _, length, task, index = cell
    inst = make_instance(task, tok, length, index, cfg.seed, cfg.haystack)
    ids = tok(inst.context).input_ids
    base = cell_base(SimpleNamespace(config=config), model_name, length, inst, len(ids), None)
    rows = []
    for method, (peer, server) in servers.items():
        row = dict(base, method=method, family="peer", peer=describe)
        try:
            if isinstance(server, Exception):
                raise server
            if task in FIDELITY:
                raise NotImplementedError("llama-server gives no logits over a teacher-forced continuation")
            # the context alone, all of it computed (an earlier cell's shared prefix is not reused), then
            # kept in the slot for the questions
            pre = server.complete(ids, 0, reuse=False)["timings"]
            kv = bytes_per_token(peer, config, len(ids)) * len(ids)
            answers = [answer(tok, ids, q, server) for q in inst.questions]
            costs = dict(kv_bytes=kv, compress_s=None, bytes_read_per_step=kv, dense_bytes_read_per_step=kv)
            row["prefill_s"] = pre["prompt_ms"] / 1e3
            answered(row, inst, [dict(a, **costs) for a in answers])
        except Exception as exc:  # the peer's own failure on this cell is a result, reported
            rows.append(failed(row, exc))
            continue
        rows.append(costed(row, len(ids)))
    return rows


def _start(stack: ExitStack, binary: Path, gguf: Path, peer: PeerSpec, context: int, log: Path):
    """A started server, or the exception that says why it would not start (its rows report it)."""
    try:
        return stack.enter_context(LlamaServer(binary, gguf, *server_args(peer, context), log_path=log))
    except RuntimeError as exc:
        return exc


def _binary() -> Path:
    """llama-server, with a progress bar while it is being built (none when it is there)."""
    bars: list = []

    def progress(percent: int) -> None:
        if not bars:
            bars.append(tqdm(total=100, desc="building llama-server", unit="%"))
        bars[0].update(percent - bars[0].n)

    try:
        return ensure(log=tqdm.write, progress=progress)
    finally:
        for bar in bars:
            bar.close()


def run_llamacpp(cfg, cells: list[tuple], methods: list[str], done: set[tuple], path: Path) -> None:
    """Run each missing (cell, llama.cpp type) row and append it to `path`."""
    todo = [c for c in cells if any((*c, m) not in done for m in methods)]
    if not todo:
        return
    binary = _binary()
    with path.open("a") as f, tempfile.TemporaryDirectory(prefix="kvstrata-llamacpp-") as logs:
        for model_name in dict.fromkeys(c[0] for c in todo):
            mine = [c for c in todo if c[0] == model_name]
            gguf = gguf_for(model_name)
            describe = f"{version(binary)} (llama-server, GGUF {weights(gguf)} weights)"
            tok, config = load_tokenizer(model_name), load_config(model_name)
            context = max(c[1] for c in mine) + 512
            with ExitStack() as stack:
                servers = {}
                for m in methods:
                    peer = parse_peer(m)
                    log = Path(logs) / f"{model_name}-{peer.name}-{peer.params['v']}.log"
                    servers[m] = (peer, _start(stack, binary, gguf, peer, context, log))
                for cell in tqdm(mine, desc=f"llama.cpp rows {model_name}", unit="cell"):
                    want = {m: s for m, s in servers.items() if (*cell, m) not in done}
                    for row in run_cell(tok, config, model_name, cell, want, describe, cfg):
                        f.write(json.dumps(row) + "\n")
                        f.flush()
