"""`kvstrata bench`: every method on the same model, length and task instances; one JSONL row per
(model, length, task, instance, method); finished rows are skipped on rerun."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from kvstrata.hf import linear
from kvstrata.methods import parse_method
from kvstrata.models import load
from kvstrata.read.kernels import cpu
from kvstrata_lab.bench import likelihood, protocol
from kvstrata_lab.bench.cells import answered, cell_base, costed, failed
from kvstrata_lab.bench.config import DEFAULT_METHODS, QUICK, STOCK, BenchConfig  # noqa: F401 (the runner's settings)
from kvstrata_lab.bench.peers import is_peer, parse_peer, qcache
from kvstrata_lab.bench.peers.llamacpp import run_llamacpp
from kvstrata_lab.bench.peers.worker_client import run_kvpress
from kvstrata_lab.bench.results import load_meta, save_meta
from kvstrata_lab.bench.rows import done_keys
from kvstrata_lab.bench.tasks import FAMILY_TASKS, FIDELITY, KNOWN, REASON_TASKS, make_instance

#: the tasks whose rows carry the answer-likelihood measure (the RULER rows stay as fast as they were)
LIKELIHOOD_TASKS = FAMILY_TASKS + REASON_TASKS


# Eviction budgets match the quantizers' bytes per token: fp8 ~0.53, nvfp4/mxfp4 ~0.28, int2 ~0.19 of bf16.
def family(spec: str) -> str:
    """Method family for colours and grouping: reference, quantization, eviction, eviction+quant."""
    if is_peer(spec):
        return "peer"
    if spec in STOCK:
        return "reference"
    m = parse_method(spec)
    if m.full.read is not None:
        return "sparse-read"
    if m.full.depth is not None:
        return "depth"
    keep = any(r.keep is not None for r in m.recipes())
    quant = any(r.codec.name != "bf16" or r.value_codec.name != "bf16" for r in m.recipes())
    if keep:
        return "eviction+quant" if quant else "eviction"
    return "quantization" if quant else "reference"


def run(cfg: BenchConfig, load_model=None) -> Path:
    """Run every missing cell; returns the JSONL path."""

    for t in cfg.tasks:
        if t not in KNOWN:
            raise ValueError(f"unknown task {t!r} (known: {', '.join(KNOWN)})")
    peers = {p: parse_peer(p) for p in cfg.peers}
    specs = {m: parse_method(m) for m in cfg.methods if m not in STOCK}
    in_process = [*cfg.methods, *(p for p in cfg.peers if peers[p].project == "qcache")]
    workers = [p for p in cfg.peers if peers[p].project == "kvpress"]
    llama = [p for p in cfg.peers if peers[p].project == "llamacpp"]
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / "results.jsonl"
    done = done_keys(path)
    # instance index outermost: an interrupted run still covers every model, length and task
    cells = [(m, L, t, i) for i in range(cfg.n) for m, L in cfg.plan() for t in cfg.tasks]
    todo = [c for c in cells if any((*c, meth) not in done for meth in in_process)]
    _write_meta(cfg)
    if todo:  # build (or load) the decode kernel now, so its one-time build is never timed as decode
        cpu.load()
    bar = tqdm(total=len(todo), desc="bench cells", unit="cell")
    step = tqdm(desc="this cell", unit="answer", leave=False)  # progress within a cell: one per question
    loaded: dict[str, tuple] = {}
    with path.open("a") as f:
        for model_name, length, task, index in todo:
            if model_name not in loaded:
                loaded[model_name] = load_model(model_name) if load_model else load(model_name, cfg.dtype)
            model, tok = loaded[model_name]
            bar.set_postfix_str(f"{model_name} {length} {task}#{index}")
            missing = [m for m in in_process if (model_name, length, task, index, m) not in done]
            for row in run_cell(model, tok, model_name, length, task, index, missing, specs, cfg, step):
                f.write(json.dumps(row) + "\n")
                f.flush()
            bar.update(1)
    step.close()
    bar.close()
    if workers:
        run_kvpress(cfg, cells, workers, done, path)
    if llama:
        run_llamacpp(cfg, cells, llama, done, path)
    return path


# the stock rows: transformers' own caches and attention, no kvstrata code on the path
STOCK_ASK = {protocol.DYNAMIC: protocol.ask_dynamic, protocol.STATIC: protocol.ask_static}
STOCK_FIDELITY = {protocol.DYNAMIC: protocol.fidelity_dynamic, protocol.STATIC: protocol.fidelity_static}


def run_cell(model, tok, model_name, length, task, index, methods, specs, cfg, step=None) -> list[dict]:
    """The rows of one cell (instance `index` of `task` at `length`), one per method; `step`: a tqdm bar
    advanced per question answered (per method on a fidelity task). Each row records the machine's
    1-minute load average when it was timed (`load_1m`, of `cores`): the report marks busy timings."""
    inst = make_instance(task, tok, length, index, cfg.seed, cfg.haystack)
    step = step if step is not None else tqdm(disable=True)
    step.reset(total=len(methods) * (1 if task in FIDELITY else len(inst.questions)))
    step.set_postfix_str(f"{task}#{index}")
    ids = tok(inst.context, return_tensors="pt").input_ids
    # refuses a context of the wrong length
    base = cell_base(model, model_name, length, inst, ids.shape[1], None)
    pre = protocol.prefill(model, ids)
    base["prefill_s"] = pre.seconds
    base["dtype"] = cfg.dtype
    if cpu.chosen_scores() != "float":  # keys scored in integers (KVSTRATA_KERNEL_SCORES): not the reference
        base["kernel_scores"] = cpu.chosen_scores()
    base["linear"] = linear.in_use(model)  # torch's linear layers or the kernel's (`kvstrata.hf.linear`)
    rows = []
    ref = None
    if task in FIDELITY:
        cont = tok(inst.continuation, add_special_tokens=False, return_tensors="pt").input_ids
        ref = protocol.reference_logits(model, pre, cont)
    # on the family tasks (where *holds* is decided), the reference answer teacher-forced over bf16's
    # cache: every row's answer likelihood is paired with it
    ref_lp = likelihood.method_logprobs(model, tok, pre, "bf16", parse_method("bf16"), inst.questions[0]) \
        if task in LIKELIHOOD_TASKS else None
    for method in methods:
        row = dict(base, method=method, family=family(method))
        peer = parse_peer(method) if is_peer(method) else None
        if peer is not None:
            row["peer"] = qcache.describe(peer)
        try:
            if task in FIDELITY:
                res = (
                    qcache.fidelity(model, pre, peer, cont, ref)
                    if peer
                    else STOCK_FIDELITY[method](model, pre, cont, ref)
                    if method in STOCK_FIDELITY
                    else protocol.fidelity(model, pre, specs[method], cont, ref)
                )
                row.update(res, score=res["top1"], failure=None)
                step.update(1)
            else:
                answers = []
                for q in inst.questions:
                    answers.append(
                        qcache.ask(model, tok, pre, peer, q)
                        if peer
                        else STOCK_ASK[method](model, tok, pre, q)
                        if method in STOCK_ASK
                        else protocol.ask(model, tok, pre, specs[method], q, context=inst.context)
                    )
                    step.update(1)
                answered(row, inst, answers)
                if peer is None and ref_lp is not None:
                    got = likelihood.method_logprobs(model, tok, pre, method, specs.get(method),
                                                     inst.questions[0])
                    row.update(likelihood.compare(ref_lp, got))
        except Exception as exc:
            if peer is None:
                raise
            rows.append(failed(row, exc))  # a peer failing on a model is a result, reported
            continue
        row.update(load_1m=round(os.getloadavg()[0], 2), cores=os.cpu_count())
        rows.append(costed(row, pre.tokens))
    del pre
    return rows


def _write_meta(cfg: BenchConfig) -> None:
    stored = load_meta(cfg.out)
    before = {r.get("dtype", "float32") for r in stored.get("runs", [])} - {cfg.dtype}
    if before:  # done rows are keyed without the dtype: one directory holds one dtype's rows
        raise ValueError(f"{cfg.out} holds rows of a {before.pop()} model; run --dtype {cfg.dtype} into "
                         "another --out")
    meta = {"dtype": cfg.dtype, "kernel_scores": cpu.chosen_scores(),
        "plan": cfg.plan(), "tasks": cfg.tasks, "methods": cfg.methods, "n": cfg.n, "seed": cfg.seed,
        "haystack": cfg.haystack, "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "cores": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stored["runs"] = stored.get("runs", []) + [meta]  # other keys (the report's decode source) kept
    save_meta(cfg.out, stored)
