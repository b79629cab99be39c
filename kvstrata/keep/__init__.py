"""Keep stratum: which tokens stay at all. One policy per module, one registry here."""

from kvstrata.keep.base import KeepPolicy
from kvstrata.keep.snapkv import SnapKV, window_scores
from kvstrata.keep.streaming import StreamingLLM

KEEP_POLICIES: dict[str, type] = {p.name: p for p in (StreamingLLM, SnapKV)}

__all__ = ["KEEP_POLICIES", "KeepPolicy", "SnapKV", "StreamingLLM", "window_scores"]
