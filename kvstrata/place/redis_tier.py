"""Redis tier (redis-py): one key per record with `PX` TTLs, a connection pool, socket timeouts
with bounded retries, pipelined batches, and Redis Cluster with hash tags.

Any transport failure (server down, slow past the socket timeout) is answered as a miss and
counted; it never raises into the serving path, and never returns a partial value (Redis SET /
GET are atomic per key).
"""

from __future__ import annotations

import time

from kvstrata.place.tier import TierStats


class RedisTier:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvstrata", cluster: bool = False,
                 socket_timeout: float = 0.5, retries: int = 1, max_connections: int = 16, client=None):
        import redis

        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.prefix = prefix
        self.retries = retries
        self.stats = TierStats()
        if client is not None:
            self.client = client
        elif cluster:
            from redis.cluster import RedisCluster

            self.client = RedisCluster.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        else:
            pool = redis.ConnectionPool.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                                                 max_connections=max_connections)
            self.client = redis.Redis(connection_pool=pool)

    def _key(self, key: str, group: str = "") -> str:
        # `{group}` is a Redis Cluster hash tag: a prefix chain's blocks land on one slot
        return f"{self.prefix}:{{{group or key[:16]}}}:{key}"

    def _call(self, fn):
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except self._errors:
                if attempt == self.retries:
                    self.stats.errors += 1
                    return None
                time.sleep(0.01 * (attempt + 1))

    def get(self, key: str, group: str = "") -> bytes | None:
        value = self._call(lambda: self.client.get(self._key(key, group)))
        if value is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return value

    def put(self, key: str, value: bytes, ttl_s: float | None = None, group: str = "") -> bool:
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        ok = self._call(lambda: self.client.set(self._key(key, group), value, px=px))
        if ok:
            self.stats.writes += 1
            return True
        self.stats.refused += 1
        return False

    def get_many(self, keys: list[str], group: str = "") -> list[bytes | None]:
        """One pipelined round trip for a chain of blocks."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self._key(k, group))
            return pipe.execute()

        values = self._call(run)
        if values is None:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        for v in values:
            if v is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return list(values)

    def put_many(self, items: list[tuple[str, bytes]], ttl_s: float | None = None, group: str = "") -> bool:
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self._key(k, group), v, px=px)
            return pipe.execute()

        ok = self._call(run)
        if ok is None:
            self.stats.refused += len(items)
            return False
        self.stats.writes += len(items)
        return True

    def delete(self, key: str, group: str = "") -> None:
        self._call(lambda: self.client.delete(self._key(key, group)))

    def keys(self) -> list[str]:
        found = self._call(lambda: list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))) or []
        return [k.decode().rsplit(":", 1)[-1] for k in found]

    def nbytes(self) -> int:
        def run():
            return sum(self.client.memory_usage(k) or 0 for k in self.client.scan_iter(match=f"{self.prefix}:*"))

        return self._call(run) or 0
