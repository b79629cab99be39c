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


def test_a_model_with_a_chat_template_gets_the_conversation_through_it(tiny_gemma, tmp_path):
    """`kvstrata chat` renders every turn through the tokenizer's chat template (the assistant's turn
    opened, a tool result as a user message that says so), each prompt extends the one before it (so the
    store finds the earlier blocks), and the replay's line says what it replayed and what was new."""
    from kvstrata.cli.chat import script_turns
    from kvstrata.models.tiny import CHAT_TEMPLATE

    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    turns = script_turns("System: be brief. " + "Reference text. " * 4 + "\nUser: what is x?\nAssistant:\n"
                         "---\nTool result: x = 1\nAssistant:\n---\nUser: and y?\n---\nUser: thanks")
    assert [[m["role"] for m in t] for t in turns] == [["system", "user"], ["tool"], ["user"], ["user"]]
    store = KVStore(DiskTier(tmp_path, 1 << 26), MemoryTier(1 << 24))
    server = PrefixServer(tiny_gemma, store, "bf16", block_size=8)
    prompts = []
    serve = server.serve
    server.serve = lambda ids: prompts.append(ids) or serve(ids)
    out = io.StringIO()
    log = chat(tiny_gemma, tok, server, turns, max_new_tokens=3, forget_swa_before={3}, out=out)
    first = tok.apply_chat_template([{"role": "system", "content": turns[0][0]["content"]},
                                     {"role": "user", "content": "what is x?"}], tokenize=False,
                                    add_generation_prompt=True)
    assert prompts[0] == tok(first, add_special_tokens=False).input_ids
    text = tok.decode(prompts[1])
    assert text.startswith(first) and "<|user|>Tool result: x = 1\n<|assistant|>" in text
    assert text.endswith("<|assistant|>") and "Assistant:" not in text
    assert all(b[:len(a)] == a for a, b in zip(prompts, prompts[1:]))  # each prompt extends the last
    assert [r["kind"] for r in log] == ["miss", "hit", "replay", "hit"]
    line = out.getvalue().splitlines()[2]
    replay = log[2]
    new = replay["prompt_tokens"] - replay["reused"]
    assert f"{replay['reused']:,} from the store" in line
    assert f"ran {replay['computed']:,} = {replay['computed'] - new:,} replayed + {new:,} new" in line


def test_a_base_model_gets_role_lines_and_its_answer_stops_at_the_next_label(tiny_gemma, tmp_path):
    """No chat template: `Role: text` lines with an `Assistant:` cue, the reply cut where the model
    begins the next turn's label."""
    from kvstrata.place.chat import Conversation

    tok = byte_tokenizer()
    convo = Conversation(tok)
    ids = convo.prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=True) == "be brief\nUser: hi\nAssistant:"
    answer = tok(" hello\nUser: more", add_special_tokens=False).input_ids
    assert convo.ends(answer) and convo.answered(answer) == " hello"
    again = convo.prompt([{"role": "tool", "content": "x = 1"}])
    assert again[:len(ids)] == ids and tok.decode(again).endswith("\nTool result: x = 1\nAssistant:")
