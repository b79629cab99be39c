"""`kvstrata serve` in a child process on 127.0.0.1 and a free port (for serve-bench and the tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ENTRY = "import sys; from kvstrata.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict | None = None, log_path: str | Path | None = None,
                 name: str = "model"):
        self.model, self.args, self.name = model, args, name
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.port = free_port()
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="kvstrata-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout_s: float = 300.0) -> "ServerProcess":
        cmd = [sys.executable, "-c", ENTRY, "serve", "--model", self.model, "--served-model-name", self.name,
               "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstrata serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                self.health()
                return self
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kvstrata serve did not answer /health within {timeout_s:.0f} s: "
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read()

    def health(self) -> dict:
        return json.loads(self._get("/health"))

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` (e.g. `kvstrata_store_corrupt_total`) whose labels include
        `labels`."""
        from prometheus_client.parser import (
            text_string_to_metric_families,  # optional dependency (the serve extra)
        )

        total = 0.0
        for fam in text_string_to_metric_families(self._get("/metrics").decode()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def wait_healthy(self, timeout_s: float = 300.0) -> bool:
        """Until /health answers (a server being restarted); False if it did not within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                self.health()
                return True
            except OSError:
                time.sleep(0.2)
        return False

    def wait_written(self, timeout_s: float = 60.0) -> None:
        """Until every record the server accepted is written to its tiers."""
        end = time.monotonic() + timeout_s
        while self.health()["pending_writes"]:
            if time.monotonic() > end:
                raise TimeoutError("the server's store writes did not finish")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush (a crash)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT: uvicorn's graceful shutdown (the store's queued writes are flushed)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
