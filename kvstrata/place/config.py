"""Store configuration: one dataclass, documented defaults, loadable from a TOML file or env vars.

Every value is checked by type and range where the dataclass is built (so the Python API and
the CLI refuse the same things): booleans are booleans (`redis_cluster = "false"` is refused, not
truthy), sizes and durations are finite numbers in range, integers are integers.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvstrata.place.secret import SecretError, parse_hex, parse_list
from kvstrata.user_files import read_text_file

ENV_PREFIX = "KVSTRATA_STORE_"
CONFIG_MAX_BYTES = 1 << 20

# name -> (low, high, low inclusive) for numbers
_RANGES = {
    "global_capacity_gb": (0.0, 1e6, False),
    "retention_hours": (0.0, 1e5, True),
    "swa_ttl_seconds": (0.0, 1e7, False),
    "swa_ram_share": (0.0, 1.0, False),
    "block_size": (1, 1 << 16, True),
    "redis_timeout_seconds": (0.0, 3600.0, False),
    "redis_check_seconds": (0.0, 86400.0, False),
}


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class StoreConfig:
    """Defaults follow V4.1: global KV kept >= 72 h; SWA KV in a pool of 10 % of host RAM, TTL minutes."""

    root: str = "~/.cache/kvstrata/store"  # local-disk tier for global KV (and the default secret file)
    global_capacity_gb: float = 16.0
    retention_hours: float = 72.0  # minimum retention of global KV; a full tier refuses writes
    swa_ttl_seconds: float = 300.0
    swa_ram_share: float = 0.10  # SWA pool capacity as a share of host RAM
    block_size: int = 256  # tokens per cached block
    redis_url: str = ""  # when set, global KV goes to Redis (shared by a fleet: share the secret too)
    redis_cluster: bool = False
    redis_timeout_seconds: float = 0.5
    redis_allow_eviction: bool = False  # accept a maxmemory-policy that may evict global KV early
    secret: str = field(default="", repr=False)  # hex HMAC key for records (else read from secret_file)
    secret_file: str = ""  # default: <root>/.kvstrata-secret, created 0600 on first use (local stores)
    previous_secrets: str = field(default="", repr=False)  # comma-separated hex: verify, never sign
    redis_check_seconds: float = 10.0  # how often the live Redis eviction policy is re-checked
    read_only: bool = False  # serve the store's records, write none (also chosen for a root not writable)

    def __post_init__(self):
        for f in fields(self):
            problem = check_value(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"store setting {f.name}: {problem}")
        if self.redis_url and not (self.secret or self.secret_file):
            raise ValueError(
                "store setting secret: a store on Redis is shared by a fleet, so it needs the fleet's "
                "secret: set secret (or KVSTRATA_STORE_SECRET, hex) or secret_file on every machine; "
                "a machine with its own secret would read the fleet's records as unverifiable"
            )

    @property
    def swa_capacity_bytes(self) -> int:
        return int(host_ram_bytes() * self.swa_ram_share)

    @classmethod
    def load(cls, path: str | Path | None = None, env: dict | None = None) -> "StoreConfig":
        """Defaults, overridden by a TOML file's [store] table, overridden by KVSTRATA_STORE_* env vars."""
        kinds = {f.name: type(f.default) for f in fields(cls)}
        values: dict = {}
        if path:
            values.update(_toml_table(path))
            unknown = set(values) - set(kinds)
            if unknown:
                raise ValueError(f"{path}: unknown store settings: {', '.join(sorted(unknown))} "
                                 f"(known: {', '.join(kinds)})")
            for name, value in values.items():
                problem = check_value(name, value)
                if problem:
                    raise ValueError(f"{path}: [store] {name}: {problem}")
        env = os.environ if env is None else env
        for name, kind in kinds.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _from_env(ENV_PREFIX + name.upper(), name, kind, raw)
        return cls(**values)


def check_value(name: str, value) -> str | None:
    """Why `value` is not acceptable for store setting `name`, or None."""
    kind = type(next(f for f in fields(StoreConfig) if f.name == name).default)
    if kind is bool and not isinstance(value, bool):
        return f"expected true or false, got {value!r}"
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"expected an integer, got {value!r}"
    if kind is float and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    ):
        return f"expected a finite number, got {value!r}"
    if kind is str and not isinstance(value, str):
        return f"expected a string, got {value!r}"
    if name in _RANGES:
        lo, hi, inclusive = _RANGES[name]
        if not (lo <= value if inclusive else lo < value) or value > hi:
            return f"must be {'>=' if inclusive else '>'} {lo} and <= {hi:g}, got {value!r}"
    if name == "redis_url" and value and urlscheme(value) not in ("redis", "rediss", "unix"):
        return f"expected a redis://, rediss:// or unix:// URL, got {urlscheme(value) or 'no scheme'}"
    if name in ("secret", "previous_secrets") and value:
        try:
            (parse_list if name == "previous_secrets" else parse_hex)(value, name)
        except SecretError as exc:
            return str(exc).removeprefix(f"{name}: ")
    return None


def urlscheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def _toml_table(path: str | Path) -> dict:

    text = read_text_file(path, "--config", CONFIG_MAX_BYTES)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    table = doc.get("store", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [store] must be a table")
    return table


def _from_env(var: str, name: str, kind: type, raw: str):
    text = raw.strip()
    try:
        if kind is bool:
            if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError
            return text.lower() in ("1", "true", "yes", "on")
        return kind(text)
    except ValueError:
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "text"}[kind]
        raise ValueError(f"{var}: expected {expected}, got {raw!r}") from None
