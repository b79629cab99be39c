import io

from kvstrata.models.tiny import byte_tokenizer
from kvstrata.place.chat import chat
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import KVStore


def test_chat_turns_hit_replay_miss(tiny_gemma, tmp_path):
    store = KVStore(DiskTier(tmp_path, 1 << 26), MemoryTier(1 << 24))
    server = PrefixServer(tiny_gemma, store, "nvfp4;sliding=fp8", block_size=8)
    turns = ["the first question is long enough to fill blocks", "a follow-up", "another one", "and a last"]
    out = io.StringIO()
    log = chat(tiny_gemma, byte_tokenizer(), server, turns, max_new_tokens=4, forget_swa_before={3}, out=out)
    assert [r["kind"] for r in log] == ["miss", "hit", "replay", "hit"]
    assert all(r["reused"] > 0 for r in log[1:]) and log[2]["computed"] < log[2]["prompt_tokens"]
    assert "[turn 3] replay" in out.getvalue()
