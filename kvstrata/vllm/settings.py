"""The connector's configuration (vLLM's `kv_connector_extra_config`) and the records' namespace.

Every key is checked when the engine starts: an unknown key, an unknown method or an unreadable
store config is one clear line then, never a silent default halfway through serving.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvstrata.place.config import StoreConfig
from kvstrata.place.prefix_keys import model_fingerprint, namespace
from kvstrata.place.store import KVStore

#: extra-config key -> what it sets
KEYS = {
    "method": "how chunks are held at rest: 'lossless' (the engine's bf16) or a store spec such as "
              "'nvfp4'",
    "store": "a store TOML file ([store] table, as `kvstrata serve --config` reads); KVSTRATA_STORE_* apply",
    "chunk_tokens": "tokens per record: a multiple of vLLM's block size (default: the store's block_size, "
                    "rounded down to one)",
}
#: what vLLM's layout adds to the namespace: records of this connector are never read as our own server's
LAYOUT = "vllm-chunks-1"


_STORES: dict[StoreConfig, KVStore] = {}
_STORES_LOCK = threading.Lock()


def shared_store(cfg: StoreConfig) -> KVStore:
    """One store per configuration and process: an engine's scheduler and worker (one process unless
    the executor runs several) share it, so lookups see the SWA pool the worker writes (the pool is
    the process's memory: an engine restart empties it, by design)."""
    with _STORES_LOCK:
        if cfg not in _STORES:
            _STORES[cfg] = KVStore.from_config(cfg)
        return _STORES[cfg]


class ConfigError(ValueError):
    """The connector's configuration is wrong (said at engine start)."""


@dataclass(frozen=True)
class Settings:
    method: str
    store: StoreConfig
    chunk_tokens: int

    @classmethod
    def parse(cls, extra: dict | None, block_size: int) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ConfigError(f"kvstrata connector: unknown kv_connector_extra_config keys {unknown} "
                              f"(known: {', '.join(KEYS)})")
        method = extra.get("method", "lossless")
        if not isinstance(method, str) or not method:
            raise ConfigError(f"kvstrata connector: method must be a spec string, got {method!r}")
        try:
            store = StoreConfig.load(extra.get("store") or None)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"kvstrata connector: store config: {exc}") from None
        chunk = extra.get("chunk_tokens", store.block_size // block_size * block_size)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < block_size or chunk % block_size:
            raise ConfigError(f"kvstrata connector: chunk_tokens must be a positive multiple of vLLM's block "
                              f"size {block_size}, got {chunk!r}")
        return cls(method=method, store=store, chunk_tokens=chunk)


def files_fingerprint(model_dir: str | Path) -> str:
    """The model as an engine loads it: its config and a digest of its weight files' bytes (hashed once
    per process while the files keep their size and modification time: the scheduler and the worker
    side of one engine both ask)."""
    root = Path(model_dir)
    files = (root / "config.json", *sorted(root.glob("*.safetensors")))
    return _fingerprint(root, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@lru_cache(maxsize=8)
def _fingerprint(root: Path, files: tuple) -> str:
    config = json.loads((root / "config.json").read_text())
    h = hashlib.sha256()
    for name, _, _ in files[1:]:
        h.update(name.encode() + b"\0")
        with (root / name).open("rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return model_fingerprint(config, h.hexdigest())


def records_namespace(model_dir: str | Path, method_text: str, dtype: str, chunk_tokens: int,
                      pooled: tuple[int, ...] = ()) -> bytes:
    """Namespace of this engine's records: model files, canonical method, engine dtype, chunk layout and
    which layers go to the SWA pool (`pooled`: vLLM's hybrid allocator on), so a record holding every
    layer and one holding the full-attention layers alone are never read as each other."""
    layout = f"{LAYOUT}/{chunk_tokens}" + (f"/pooled:{','.join(map(str, pooled))}" if pooled else "")
    return namespace(files_fingerprint(model_dir), method_text, dtype, layout_version=layout)
