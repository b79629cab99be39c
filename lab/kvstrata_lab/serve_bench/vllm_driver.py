"""One real vLLM engine (CPU backend, eager, in-process) and a list of steps, run with vLLM's own
environment (`make vllm-env`) by file path -- it imports vLLM and kvstrata, never the lab:
`python vllm_driver.py request.json`. Prints one JSON line per step. Used by the connector's tests
and by `kvstrata vllm-bench`.

Request: {"model": dir, "engine": {...LLM keyword overrides}, "connector": null | {"name":
"KvstrataConnector" | "ExampleConnector", "extra": {...}}, "chunk_tokens", "steps": [...]}. Steps:
- {"op": "generate", "prompt": [ids], "salt": str | null, "max_tokens": n} -> tokens, text, logprobs of
  each chosen token, cached (vLLM's num_cached_tokens: its own prefix cache plus a connector's hits),
  seconds (the whole call; with max_tokens 1 that is the time to the first token), cpu_s (the process's
  CPU seconds in it, every thread)
- {"op": "conversation", "system": text, "turns": [text], "answer_tokens": n}: each turn's transcript
  (system, then "User: ... / Assistant:" with the earlier answers) timed to its first token, then
  answered -> per turn: ttft, cached, prompt tokens, answer
- {"op": "reset"}: drop vLLM's own prefix cache (so only a connector can serve a prefix)
- {"op": "wait_records", "prompt": [ids], "salt", "chunks": n}: until the first n chunks' records exist
- {"op": "tamper", "prompt", "salt", "chunk": j, "how": "flip" | "copy_from", "source": i}: damage the
  record of chunk j on disk (one payload byte flipped, or chunk i's record put under j's name)
- {"op": "forge", "prompt", "salt", "chunk": j}: a record signed with the store's secret under chunk j's
  key and namespace that is no chunk (it passes the lookup, fails the load)
- {"op": "stats"}: the kvstrata connector's counters since the engine started (writes landed first) and
  which layers its records keep persistently / in the SWA pool
- {"op": "kill", "pid": n}: SIGKILL a process (the Redis server under the store)
- {"op": "start", "extra": {...}}: only construct an engine with the connector's extra config changed;
  -> the error it raised (its first line) or "started"
- {"op": "disk", "path": dir}: bytes and files under it, once they stop changing (writes land)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group  # noqa: E402

from kvstrata.place.config import StoreConfig  # noqa: E402
from kvstrata.place.disk_root import SUFFIX  # noqa: E402
from kvstrata.place.prefix_keys import block_hashes  # noqa: E402
from kvstrata.place.store import KVStore  # noqa: E402
from kvstrata.vllm.chunks import ChunkCodec  # noqa: E402
from kvstrata.vllm.settings import records_namespace  # noqa: E402

ENGINE = {"dtype": "bfloat16", "enforce_eager": True, "block_size": 32, "kv_cache_memory_bytes": 128 << 20,
          "distributed_executor_backend": "uni", "max_model_len": 2048, "seed": 0}


def engine(req: dict, extra: dict | None = None) -> LLM:
    conn = req.get("connector")
    kwargs = {**ENGINE, **req.get("engine", {})}
    if conn:
        module = {"kv_connector_module_path": "kvstrata.vllm"} if conn["name"] == "KvstrataConnector" else {}
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=conn["name"], kv_role="kv_both", **module,
            kv_connector_extra_config={**conn.get("extra", {}), **(extra or {})})
    return LLM(model=req["model"], **kwargs)


def namespace(req: dict) -> bytes:
    """The kvstrata connector's records namespace for this engine (the live connector's, once it runs)."""
    if has_kv_transfer_group() and hasattr(get_kv_transfer_group(), "ns"):
        return get_kv_transfer_group().ns
    extra = req["connector"]["extra"]
    layers = json.loads((Path(req["model"]) / "config.json").read_text())["num_hidden_layers"]
    text = ChunkCodec.build(extra["method"], ["full"] * layers, 1, 64, torch.bfloat16).text
    return records_namespace(req["model"], text, "bfloat16", extra["chunk_tokens"])


def chunk_keys(req: dict, step: dict) -> list[str]:
    """The store keys of the prompt's chunks, as the kvstrata connector computes them."""
    salt = (step.get("salt") or "").encode()
    tokens = req["connector"]["extra"]["chunk_tokens"]
    return [k.hex() for k in block_hashes(step["prompt"], tokens, namespace(req), tenant_salt=salt)]


def record_path(req: dict, step: dict, chunk: int) -> Path:
    root = StoreConfig.load(req["connector"]["extra"]["store"]).root
    return Path(root).expanduser() / f"{chunk_keys(req, step)[chunk]}{SUFFIX}"


def generate(llm: LLM, ids: list[int], max_tokens: int, salt: str | None = None) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)
    prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
    t0, cpu0 = time.perf_counter(), time.process_time()
    res = llm.generate(prompt, params, use_tqdm=False)[0]
    gen = res.outputs[0]
    return {"tokens": list(gen.token_ids), "text": gen.text, "cached": res.num_cached_tokens,
            "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
            "prompt_tokens": len(ids),
            "logprobs": [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)]}


def conversation(llm: LLM, step: dict) -> list[dict]:
    tok = llm.get_tokenizer()
    text, out = step["system"], []
    for turn in step["turns"]:
        text += f"\n\nUser: {turn}\nAssistant:"
        ids = tok(text)["input_ids"]
        first = generate(llm, ids, 1)
        answer = generate(llm, ids, step["answer_tokens"])
        out.append({"ttft": first["seconds"], "cached": first["cached"], "prompt_tokens": len(ids),
                    "answer": answer["text"], "tokens": answer["tokens"]})
        text += " " + answer["text"].strip()
    return out


def disk(path: str) -> tuple[int, int]:
    """(bytes, files) under `path`, hidden files (a store's secret and ledger) left out."""
    files = [p for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sum(p.stat().st_size for p in files), len(files)


def step_result(req: dict, llm: LLM | None, step: dict) -> tuple[LLM | None, dict]:
    op, out = step["op"], {"op": step["op"], "tag": step.get("tag")}
    if op == "start":
        try:
            engine(req, step["extra"])
            out["result"] = "started"
        except Exception as exc:  # what a user sees: the innermost message
            while exc.__cause__ is not None:
                exc = exc.__cause__
            out["result"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return llm, out
    if op in ("generate", "conversation", "reset"):
        llm = llm or engine(req)
    if op == "generate":
        out.update(generate(llm, step["prompt"], step["max_tokens"], step.get("salt")))
    elif op == "conversation":
        out["turns"] = conversation(llm, step)
    elif op == "reset":
        out["result"] = llm.reset_prefix_cache()
    elif op == "wait_records":
        tier = KVStore.from_config(StoreConfig.load(req["connector"]["extra"]["store"])).global_tier
        keys = chunk_keys(req, step)[: step["chunks"]]
        end = time.monotonic() + 60
        while not all(tier.get(k) is not None for k in keys) and time.monotonic() < end:
            time.sleep(0.05)
        out["result"] = all(tier.get(k) is not None for k in keys)
    elif op == "tamper":
        target = record_path(req, step, step["chunk"])
        if step["how"] == "flip":
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
        else:
            target.write_bytes(record_path(req, step, step["source"]).read_bytes())
        out["result"] = target.name
    elif op == "forge":  # signed with the store's secret, under the right key and namespace: not a chunk
        store = KVStore.from_config(StoreConfig.load(req["connector"]["extra"]["store"]))
        key = chunk_keys(req, step)[step["chunk"]]
        out["result"] = store.put_global(key, {"junk": torch.zeros(3)}, {"kv": "{}"}, namespace(req))
    elif op == "stats":
        conn = get_kv_transfer_group()
        conn.flush()  # counts of writes still on the writer thread land first
        out["totals"] = dict(conn.totals)
        out["layers"] = {"persistent": list(conn.groups.persistent), "pooled": list(conn.groups.pooled)}
    elif op == "kill":
        os.kill(step["pid"], signal.SIGKILL)
        time.sleep(0.5)
    elif op == "disk":
        if has_kv_transfer_group() and hasattr(get_kv_transfer_group(), "flush"):
            out["flushed"] = get_kv_transfer_group().flush()  # kvstrata's writes are off the forward path
        seen, end = None, time.monotonic() + 60
        while (now := disk(step["path"])) != seen and time.monotonic() < end:  # writes still landing
            seen = now
            time.sleep(0.5)
        out.update(bytes=now[0], files=now[1])
    return llm, out


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    llm = None
    for step in req["steps"]:
        llm, out = step_result(req, llm, step)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
