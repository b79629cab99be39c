"""Keep stratum: which tokens stay at all. One policy per module, one registry line each."""

from kvstrata.keep.base import KeepPolicy
from kvstrata.keep.snapkv import SnapKV, window_rows, window_scores
from kvstrata.keep.streaming import StreamingLLM
from kvstrata.keep.tova import TOVA
from kvstrata.registry import register

register(StreamingLLM, "keep")
register(SnapKV, "keep")
register(TOVA, "keep")

__all__ = ["KeepPolicy", "SnapKV", "StreamingLLM", "TOVA", "window_rows", "window_scores"]
