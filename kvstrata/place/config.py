"""Store configuration: one dataclass, documented defaults, loadable from a TOML file or env vars."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

ENV_PREFIX = "KVSTRATA_STORE_"


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class StoreConfig:
    """Defaults follow V4.1: global KV kept >= 72 h; SWA KV in a pool of 10 % of host RAM, TTL minutes."""

    root: str = "~/.cache/kvstrata/store"  # local-disk tier for global KV
    global_capacity_gb: float = 16.0
    retention_hours: float = 72.0  # minimum retention of global KV; a full tier refuses writes
    swa_ttl_seconds: float = 300.0
    swa_ram_share: float = 0.10  # SWA pool capacity as a share of host RAM
    block_size: int = 256  # tokens per cached block
    redis_url: str = ""  # when set, global KV also goes to Redis (shared by a fleet)
    redis_cluster: bool = False
    redis_timeout_seconds: float = 0.5

    def __post_init__(self):
        if self.block_size < 1 or self.retention_hours < 0 or self.swa_ttl_seconds <= 0:
            raise ValueError("block_size >= 1, retention_hours >= 0 and swa_ttl_seconds > 0 are required")
        if not 0 < self.swa_ram_share <= 1:
            raise ValueError(f"swa_ram_share must be in (0, 1], got {self.swa_ram_share}")

    @property
    def swa_capacity_bytes(self) -> int:
        return int(host_ram_bytes() * self.swa_ram_share)

    @classmethod
    def load(cls, path: str | Path | None = None, env: dict | None = None) -> "StoreConfig":
        """Defaults, overridden by a TOML file's [store] table, overridden by KVSTRATA_STORE_* env vars."""
        values: dict = {}
        if path:
            import tomllib

            values.update(tomllib.loads(Path(path).read_text()).get("store", {}))
        env = os.environ if env is None else env
        types = {f.name: type(f.default) for f in fields(cls)}
        for name, kind in types.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
        unknown = set(values) - set(types)
        if unknown:
            raise ValueError(f"unknown store settings: {', '.join(sorted(unknown))}")
        return cls(**{k: types[k](v) if types[k] is not bool else bool(v) for k, v in values.items()})
