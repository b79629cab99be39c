"""Redis fixtures: one server, servers with extra arguments, a 3-master cluster (helpers in
tests/redis_helpers.py)."""

import subprocess
import time

import pytest
from redis_helpers import RedisServer, free_port, redis_binary, redis_cli


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def start_redis():
    """Start real redis-servers with extra arguments (`--maxmemory 2mb`, `password=`); all stopped after."""
    started = []

    def start(*extra: str, password: str = "") -> RedisServer:
        started.append(RedisServer(*extra, password=password).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    """A real 3-master Redis Cluster on 127.0.0.1."""
    import redis

    binary = redis_binary()
    ports = [free_port(bus=True) for _ in range(3)]
    procs = [
        subprocess.Popen(
            [
                binary, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{p}.conf", "--save", "", "--appendonly", "no",
            ],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        for p in ports:
            for _ in range(100):
                try:
                    redis.Redis(port=p).ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
        made = subprocess.run(
            [
                redis_cli(binary), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if made.returncode:
            pytest.fail(f"redis-cli --cluster create failed: {made.stdout[-800:]} {made.stderr[-800:]}")
        for _ in range(200):
            if b"cluster_state:ok" in redis.Redis(port=ports[0]).execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(5)
