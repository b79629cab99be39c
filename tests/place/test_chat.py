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


def test_an_exact_replay_turn_answers_as_the_live_state_did(tmp_path):
    """`kvstrata chat --replay-tokens exact` on lossless KV (a bf16 model, bf16 records): the turn
    whose SWA state was dropped replays the sliding layers' receptive field and answers, turn by
    turn, what the session whose state stayed live answered."""
    import torch

    from kvstrata.models.tiny import tiny_model

    model = tiny_model("gemma3").to(torch.bfloat16)
    turns = ["a first question that is long enough to fill some blocks of the store", "a follow-up",
             "one more question, also long enough to push the prefix past the replayed tokens", "a last"]
    logs = []
    for forget in (set(), {3, 4}):
        store = KVStore(DiskTier(tmp_path / str(len(forget)), 1 << 26), MemoryTier(1 << 24))
        server = PrefixServer(model, store, "bf16", block_size=8, n_win="exact")
        logs.append(chat(model, byte_tokenizer(), server, turns, max_new_tokens=6, forget_swa_before=forget,
                         out=io.StringIO()))
    assert [r["kind"] for r in logs[1]] == ["miss", "hit", "replay", "replay"]
    assert logs[1][3]["computed"] < logs[1][3]["prompt_tokens"]  # the replay did not rerun the whole prefix
    assert [r["reply"] for r in logs[1]] == [r["reply"] for r in logs[0]]
