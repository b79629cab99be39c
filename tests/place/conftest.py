"""Redis fixtures: one server, servers with extra arguments, a 3-master cluster (helpers in
tests/redis_helpers.py)."""

import pytest
from redis_helpers import RedisServer

from kvstrata_lab.serve_bench.cluster import LoopbackCluster


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
    """A real 3-master Redis Cluster on 127.0.0.1 (the soak's `LoopbackCluster`, no replicas)."""
    cluster = LoopbackCluster(tmp_path, masters=3).start()
    try:
        yield cluster.url
    finally:
        cluster.stop()
