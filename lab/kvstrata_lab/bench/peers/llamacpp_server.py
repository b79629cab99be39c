"""One `llama-server` child process on 127.0.0.1 and a free port (the bench's llama.cpp rows and
serve-bench's llama-server peer)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from kvstrata_lab.serve_bench.child import ChildServer


class LlamaServer(ChildServer):
    what = "llama-server"

    def __init__(self, binary: Path, gguf: Path, *args: str, log_path: Path, threads: int = 2):
        super().__init__(log_path)
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-fa", "on", "-ngl", "0", "--no-webui",
                    "--seed", "0", *args]

    def post(self, path: str, body: dict, timeout_s: float = 3600.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server {path}: HTTP {e.code}: {e.read()[:300]!r}") from None

    def complete(self, ids: list[int], n_predict: int, reuse: bool = True) -> dict:
        """Greedy continuation of token ids; `reuse`: the slot's cached prefix is reused (else the
        whole prompt is computed, and then kept for the next request)."""
        return self.post("/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0.0,
                                         "top_k": 1, "cache_prompt": reuse, "return_tokens": True,
                                         "id_slot": 0})
