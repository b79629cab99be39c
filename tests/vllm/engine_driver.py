"""Runs one real vLLM engine (CPU, eager, in-process) with the kvstrata connector and a list of steps;
run by the tests with vLLM's environment (`make vllm-env`): `python engine_driver.py request.json`.
Prints one JSON line per step.

Request: {"model", "store" (TOML path), "method", "chunk_tokens", "steps": [...]}; steps:
- {"op": "generate", "prompt": [ids], "salt": str | null, "max_tokens": n} -> tokens, logprobs of
  each chosen token, num_cached_tokens (vLLM's count: its own prefix cache plus the connector's hits)
- {"op": "reset"}: drop vLLM's own prefix cache (so only the store can serve a prefix)
- {"op": "wait_records", "prompt": [ids], "salt": ..., "chunks": n}: until chunk 0..n-1's records exist
- {"op": "tamper", "prompt", "salt", "chunk": j, "how": "flip" | "copy_from", "source": i}: damage the
  record of chunk j on disk (flip one payload byte, or put chunk i's record under j's name)
- {"op": "kill", "pid": n}: SIGKILL a process (the Redis server under the store)
- {"op": "start", "method": ..., "extra": {...}}: only construct an engine with that config; prints
  the error it raised (one line) or "started"
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

from kvstrata.place.config import StoreConfig  # noqa: E402
from kvstrata.place.disk_root import SUFFIX  # noqa: E402
from kvstrata.place.prefix_keys import block_hashes  # noqa: E402
from kvstrata.place.store import KVStore  # noqa: E402
from kvstrata.vllm.chunks import ChunkCodec  # noqa: E402
from kvstrata.vllm.settings import records_namespace  # noqa: E402


def engine(req: dict, extra: dict) -> LLM:
    return LLM(model=req["model"], dtype="bfloat16", enforce_eager=True, block_size=32,
               kv_cache_memory_bytes=128 << 20, distributed_executor_backend="uni", max_model_len=2048,
               seed=0, kv_transfer_config=KVTransferConfig(
                   kv_connector="KvstrataConnector", kv_connector_module_path="kvstrata.vllm",
                   kv_role="kv_both", kv_connector_extra_config=extra))


def chunk_keys(req: dict, step: dict) -> list[str]:
    """The store keys of the prompt's chunks, as the connector computes them."""
    layers = json.loads((Path(req["model"]) / "config.json").read_text())["num_hidden_layers"]
    text = ChunkCodec.build(req["method"], ["full"] * layers, 1, 64, torch.bfloat16).text
    ns = records_namespace(req["model"], text, "bfloat16", req["chunk_tokens"])
    salt = (step.get("salt") or "").encode()
    return [k.hex() for k in block_hashes(step["prompt"], req["chunk_tokens"], ns, tenant_salt=salt)]


def record_path(req: dict, step: dict, chunk: int) -> Path:
    return Path(StoreConfig.load(req["store"]).root).expanduser() / f"{chunk_keys(req, step)[chunk]}{SUFFIX}"


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    extra = {"method": req["method"], "store": req["store"], "chunk_tokens": req["chunk_tokens"]}
    llm = None
    for step in req["steps"]:
        op = step["op"]
        out: dict = {"op": op}
        if op == "start":
            try:
                engine(req, {**extra, **step["extra"]})
                out["result"] = "started"
            except Exception as exc:  # what a user sees: the innermost message
                while exc.__cause__ is not None:
                    exc = exc.__cause__
                out["result"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        elif op == "generate":
            llm = llm or engine(req, extra)
            params = SamplingParams(max_tokens=step["max_tokens"], temperature=0, logprobs=0)
            prompt = {"prompt_token_ids": step["prompt"]}
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
            t0 = time.perf_counter()
            res = llm.generate(prompt, params, use_tqdm=False)[0]
            gen = res.outputs[0]
            out.update(tokens=list(gen.token_ids), cached=res.num_cached_tokens,
                       seconds=time.perf_counter() - t0,
                       logprobs=[lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)])
        elif op == "reset":
            out["result"] = llm.reset_prefix_cache()
        elif op == "wait_records":
            tier = KVStore.from_config(StoreConfig.load(req["store"])).global_tier
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
        elif op == "kill":
            os.kill(step["pid"], signal.SIGKILL)
            time.sleep(0.5)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
