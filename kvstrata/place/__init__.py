"""Place stratum: where KV bytes live and for how long (memory, disk, Redis; global vs SWA KV)."""

from kvstrata.place.config import StoreConfig
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.records import RecordError, decode_record, encode_record
from kvstrata.place.redis_tier import RedisTier
from kvstrata.place.store import KVStore, Lookup
from kvstrata.place.tier import StoreUnavailable

__all__ = ["DiskTier", "KVStore", "Lookup", "MemoryTier", "RecordError", "RedisTier", "StoreConfig",
           "StoreUnavailable", "decode_record", "encode_record"]
