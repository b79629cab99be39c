"""Redis tier (redis-py): one key per record with `PX` TTLs, a connection pool, socket timeouts
with bounded retries, pipelined batches, and Redis Cluster with hash tags.

Serving path: any failure (server down, slow past the socket timeout, authentication, a refusal
such as out-of-memory) is a counted miss or a counted refusal; it never raises into the serving
path and never returns a partial value (Redis SET / GET are atomic per key).
Admin path (`connect`, `keys`, `nbytes`, `ttls`): failures raise `StoreUnavailable`, so an
unreachable or unauthenticated server is never reported as an empty store. `connect` also checks
`maxmemory-policy`: global records carry a TTL equal to their retention, so any policy but
`noeviction` may evict them before it (volatile-* policies included); it is refused for the global
tier unless the caller opts in (then `describe` says retention is not guaranteed).
Redis can change under a running store (`CONFIG SET maxmemory-policy allkeys-lru`): the policy and
the server's `evicted_keys` are re-checked every `check_interval_s` on the serving path and at once
when a listed record is gone; while they break retention, `problems()` says so (stats, /health,
metrics) and global writes are refused (counted), until the server is fixed. A server's `evicted_keys`
that goes down (`CONFIG RESETSTAT`, a restart) re-baselines the count, and the check says that keys
evicted before it may be unknown.
A write with a `WriteGuard` is one Lua script (`GUARDED_SET`): Redis reads the head of what the key
holds and sets the new value only if the guard does not keep it, atomically -- another fleet member's
write can land between our read and our set no other way.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from kvstrata.place.tier import StoreUnavailable, TierBase, TierStats, WriteGuard, refuse_read_only

SAFE_POLICY = "noeviction"

#: `tier.WriteGuard.keeps`, in Redis: KEYS[1] the key; ARGV value, PX ms ("" for none), magic, version,
#: id offset (0-based), id length, min length, then the ids that may be replaced. 1: set, 0: kept; the
#: SET's own error (OOM on a full server) as the script's reply.
GUARDED_SET = """
local n = redis.call('STRLEN', KEYS[1])
if n >= tonumber(ARGV[7]) then
  local at, len = tonumber(ARGV[5]), tonumber(ARGV[6])
  local head = redis.call('GETRANGE', KEYS[1], 0, at + len - 1)
  local magic, version = ARGV[3], ARGV[4]
  if string.sub(head, 1, #magic) == magic then
    local keep = string.sub(head, #magic + 1, #magic + #version) ~= version
    if not keep then
      keep = true
      local id = string.sub(head, at + 1, at + len)
      for i = 8, #ARGV do
        if ARGV[i] == id then keep = false; break end
      end
    end
    if keep then return 0 end
  end
end
local done
if ARGV[2] == '' then done = redis.pcall('SET', KEYS[1], ARGV[1])
else done = redis.pcall('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
if type(done) == 'table' and done.err then return done end
return 1
"""


def _guard_args(guard: WriteGuard) -> list:
    ids = sorted(guard.ids)
    return [guard.magic, guard.version, guard.id_at, len(ids[0]), guard.min_length, *ids]


class EvictionPolicyError(ValueError):
    """The Redis server may evict global KV before its retention, and the user did not opt in."""


def _where(url: str) -> str:
    """host:port/db of a Redis URL, never its password."""
    u = urlsplit(url)
    return f"{u.hostname or u.path}:{u.port or 6379}{u.path if u.hostname else ''}"


class RedisTier(TierBase):
    retention_by_ttl = True  # the store expresses global retention as a Redis TTL on each record

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvstrata", cluster: bool = False,
                 socket_timeout: float = 0.5, retries: int = 1, max_connections: int = 16, client=None,
                 check_interval_s: float = 10.0, read_only: bool = False):
        import redis  # optional dependency (the redis extra)

        self._x = redis.exceptions
        self._transport = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.prefix = prefix
        self.retries = retries
        self.where = _where(url)
        self.stats = TierStats()
        self.server: dict = {}
        self.check_interval_s = check_interval_s
        self.read_only = "read_only = true" if read_only else ""
        self._guard: dict | None = None  # set by connect(global_class=True): what retention needs
        self._checked = 0.0
        self._problems: list[str] = []
        if client is not None:
            self.client = client
        elif cluster:
            from redis.cluster import RedisCluster  # optional dependency (the redis extra)

            try:  # RedisCluster connects here to learn the slot map
                self.client = RedisCluster.from_url(url, socket_timeout=socket_timeout,
                                                    socket_connect_timeout=socket_timeout)
            except redis.exceptions.RedisError as exc:
                raise StoreUnavailable(f"Redis Cluster at {self.where} cannot be reached: {exc}") from None
        else:
            pool = redis.ConnectionPool.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                max_connections=max_connections,
            )
            self.client = redis.Redis(connection_pool=pool)

    def _key(self, key: str, group: str = "") -> str:
        # `{group}` is a Redis Cluster hash tag: a prefix chain's blocks land on one slot
        return f"{self.prefix}:{{{group or key[:16]}}}:{key}"

    # --- serving path: failures are counted misses / refusals -------------------------------------
    def _call(self, fn):
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except self._transport:
                if attempt == self.retries:
                    self.stats.errors += 1
                    return None
                time.sleep(0.01 * (attempt + 1))
            except self._x.RedisError as exc:  # refused by the server: OOM, NOPERM, READONLY, WRONGTYPE, ...
                if self._out_of_memory(exc):
                    self._count("refused_out_of_memory")
                else:
                    self.stats.errors += 1
                return None

    def _out_of_memory(self, exc) -> bool:
        """A full `noeviction` server's refusal: OOM, or a script's SET refused with it (Redis 6 prefixes
        the script's line to the message)."""
        return isinstance(exc, self._x.OutOfMemoryError) or (
            isinstance(exc, self._x.ResponseError) and "OOM command not allowed" in str(exc))

    def _count(self, what: str, n: int = 1) -> None:
        self.stats.extra[what] = self.stats.extra.get(what, 0) + n

    def get(self, key: str, group: str = "") -> bytes | None:
        value = self._call(lambda: self.client.get(self._key(key, group)))
        if value is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return value

    def _write_stopped(self, n: int) -> bool:
        """True (and `n` refusals counted) while retention is broken: no new global KV until fixed."""
        if not self.problems():
            return False
        self._count("refused_retention_broken", n)
        self.stats.refused += n
        return True

    def _set(self, target, key: str, value: bytes, px: int | None, guard: WriteGuard | None):
        """SET, or with a guard the `GUARDED_SET` script (1: set, 0: kept), on a client or a pipeline."""
        if guard is None:
            return target.set(key, value, px=px)
        # EVAL by name: a Cluster pipeline has no `eval`, and routes the command by its key
        return target.execute_command("EVAL", GUARDED_SET, 1, key, value, "" if px is None else px,
                                      *_guard_args(guard))

    def put(self, key: str, value: bytes, ttl_s: float | None = None, guard: WriteGuard | None = None,
            group: str = "") -> bool:
        if self.read_only:
            return refuse_read_only(self)
        if self._write_stopped(1):
            return False
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        ok = self._call(lambda: self._set(self.client, self._key(key, group), value, px, guard))
        if guard is not None and ok == 0:
            self.stats.writes_skipped_foreign += 1
            return False
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
            return pipe.execute(raise_on_error=False)

        values = self._call(run)
        if values is None:
            values = [None] * len(keys)
        out = [v if isinstance(v, bytes) else None for v in values]
        self.stats.errors += sum(isinstance(v, Exception) for v in values)
        self.stats.misses += out.count(None)
        self.stats.hits += len(out) - out.count(None)
        return out

    def put_many(self, items: list[tuple[str, bytes]], ttl_s: float | None = None, group: str = "",
                 guard: WriteGuard | None = None) -> bool:
        """One pipelined round trip; True when every item was stored (each refusal or skip is counted)."""
        if self.read_only:
            for _ in items:
                refuse_read_only(self)
            return not items
        if self._write_stopped(len(items)):
            return False
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                self._set(pipe, self._key(k, group), v, px, guard)
            return pipe.execute(raise_on_error=False)

        results = self._call(run) or [None] * len(items)
        ok = sum(r is True or (guard is not None and r == 1) for r in results)
        kept = sum(guard is not None and r == 0 for r in results)
        self._count("refused_out_of_memory", sum(self._out_of_memory(r) for r in results))
        self.stats.writes += ok
        self.stats.writes_skipped_foreign += kept
        self.stats.refused += len(items) - ok - kept
        return ok == len(items)

    def delete(self, key: str, group: str = "") -> None:
        if self.read_only:
            return
        self._call(lambda: self.client.delete(self._key(key, group)))

    # --- admin path: failures raise StoreUnavailable ----------------------------------------------
    def _admin(self, fn, what: str):
        try:
            return fn()
        except self._x.AuthenticationError as exc:
            raise StoreUnavailable(
                f"Redis at {self.where} refused authentication while {what}: {exc}"
            ) from None
        except self._transport as exc:
            raise StoreUnavailable(f"Redis at {self.where} cannot be reached while {what}: {exc}") from None
        except self._x.RedisError as exc:
            raise StoreUnavailable(f"Redis at {self.where} refused {what}: {exc}") from None

    def connect(self, global_class: bool = True, allow_eviction: bool = False) -> dict:
        """Reach the server, authenticate, and check that it keeps global KV for its retention."""

        policies, evicted = self._admin(self._probe, "connecting")
        policy = ",".join(policies) or "unknown"
        if global_class and policies != [SAFE_POLICY] and not allow_eviction:
            raise EvictionPolicyError(
                f"Redis at {self.where} has maxmemory-policy {policy}, which may evict global KV before its "
                "retention (its records carry a TTL, so volatile-* policies evict them too): set "
                f"maxmemory-policy {SAFE_POLICY}, or opt in with redis_allow_eviction = true (retention "
                "then not guaranteed)"
            )
        self.server = {
            "server": self.where, "maxmemory_policy": policy, "eviction_allowed": allow_eviction,
            "retention_guaranteed": policies == [SAFE_POLICY],
        }
        if global_class and not allow_eviction:
            self._guard = {"evicted_keys": evicted, "lost": 0, "reset": False}
            self._checked = time.monotonic()
        return self.server

    def _probe(self) -> tuple[list[str], int]:
        """(the servers' maxmemory policies, their evicted_keys summed); raises redis errors."""
        self.client.ping()

        def nodes(section: str, field: str) -> list[dict]:
            info = self.client.info(section)
            return [info] if field in info else [n for n in info.values() if isinstance(n, dict)]

        policies = sorted({n.get("maxmemory_policy", "unknown") for n in nodes("memory", "maxmemory_policy")})
        return policies, sum(int(n.get("evicted_keys", 0)) for n in nodes("stats", "evicted_keys"))

    def problems(self, force: bool = False) -> list[str]:
        """Why global retention is broken right now ([] when it holds or was never promised); the
        server is asked again at most every `check_interval_s` unless `force`."""
        if self._guard is None:
            return []
        if force or time.monotonic() - self._checked >= self.check_interval_s:
            self._checked = time.monotonic()
            self._problems = self._recheck()
        return self._problems

    def _recheck(self) -> list[str]:
        try:
            policies, evicted = self._probe()
        except self._x.RedisError:  # unreachable now: reads and writes count that; keep the last verdict
            self.stats.errors += 1
            return self._problems
        problems = []
        policy = ",".join(policies) or "unknown"
        self.server["maxmemory_policy"] = policy
        if policies != [SAFE_POLICY]:
            problems.append(f"Redis at {self.where} now has maxmemory-policy {policy}: it may evict global "
                            f"KV before its retention; global writes stopped until it is {SAFE_POLICY} again")
        guard, seen = self._guard, self._guard["evicted_keys"]
        if evicted < seen:  # the counter went down (CONFIG RESETSTAT, a restart): count again from here
            guard["reset"] = True
            self._count("evicted_counter_resets")
        else:
            guard["lost"] += evicted - seen
            self.stats.evicted += evicted - seen
        guard["evicted_keys"] = evicted
        if guard["lost"] > 0:
            problems.append(f"Redis at {self.where} evicted {guard['lost']} keys since this store connected "
                            "(server-wide count): global KV may have been lost before its retention")
        if guard["reset"]:
            problems.append(f"Redis at {self.where}: its evicted_keys count went down (CONFIG RESETSTAT or a "
                            "restart), so keys evicted before that are unknown: global KV may have been lost "
                            "before its retention")
        if policies == [SAFE_POLICY]:  # the operator fixed it: a loss is reported once, then cleared
            guard["lost"], guard["reset"] = 0, False
        self.server["retention_guaranteed"] = not problems
        if problems:
            self.server["problems"] = problems
        else:
            self.server.pop("problems", None)
        return problems

    def keys(self) -> list[str]:
        found = self._admin(
            lambda: list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000)), "listing keys"
        )
        return [k.decode().rsplit(":", 1)[-1] for k in found]

    def nbytes(self) -> int:
        def run():
            return sum(
                self.client.memory_usage(k) or 0 for k in self.client.scan_iter(match=f"{self.prefix}:*")
            )

        return self._admin(run, "measuring memory")

    def ttls(self, keys: list[str], group: str = "") -> list[float | None]:
        """Remaining TTL in seconds per key; None for a key without a TTL, -1.0 for one that is gone."""

        def run():
            return [self.client.pttl(self._key(k, group)) for k in keys]

        return [
            None if ms == -1 else -1.0 if ms == -2 else ms / 1000 for ms in self._admin(run, "reading TTLs")
        ]

    def set_ttl(self, key: str, ttl_s: float, group: str = "") -> bool:
        if self.read_only:
            return False
        return bool(
            self._admin(
                lambda: self.client.pexpire(self._key(key, group), max(1, int(ttl_s * 1000))), "setting a TTL"
            )
        )

    def describe(self) -> dict:
        out = dict(self.server) or {"server": self.where}
        return {**out, "read_only": self.read_only} if self.read_only else out
