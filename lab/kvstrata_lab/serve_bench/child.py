"""A server child process on 127.0.0.1 and a free port, ready once `GET /health` answers 200, stopped
with SIGTERM (SIGKILL if it lingers): llama.cpp's `llama-server` and `vllm serve` as peers."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from kvstrata_lab.serve_bench.process import free_port


class ChildServer:
    what = "server"  # its name in errors

    def __init__(self, log_path: Path, env: dict | None = None):
        self.port, self.log_path, self.env = free_port(), log_path, env
        self.cmd: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            rc = self.proc.poll()
            if rc is not None:
                how = f"died of {signal.Signals(-rc).name}" if rc < 0 else f"exited with {rc}"
                raise RuntimeError(f"{self.what} {how} (log: {self.log_path.name}): {self.error_line()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:  # not listening yet, or 503 while the model loads
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.what} did not answer /health within {timeout_s:.0f} s: "
                           f"{self.error_line()}")

    def error_line(self) -> str:
        """The log's most telling line: its last error, else its last line."""
        lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        errors = [x for x in lines if "error" in x.lower() or "failed" in x.lower()]
        return (errors or lines or ["(no output)"])[-1].strip()[:300]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
