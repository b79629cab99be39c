"""`kvstrata chat`: a multi-turn session over the persistent store, showing per turn whether the
prompt was a hit, a bounded replay or a miss, what it reused and what it ran, and its time to first
token.

A turn is a list of messages (`{"role", "content"}`, roles system / user / tool / assistant) or a
plain string (one user message). With a chat template the whole conversation is rendered through it
each turn, the assistant's turn opened, as `kvstrata serve` renders `/v1/chat/completions`: the
earlier turns are a prefix of the text, so their blocks are found in the store. Without one
(a base model) turns are fed as `Role: text` lines ending in an `Assistant:` cue, appended to the
token ids so far.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

import torch

from kvstrata.hf.run import forward
from kvstrata.names import ServeKind
from kvstrata.place.prefix_server import PrefixServer

Message = dict[str, str]
#: how a role is written in a `Role: text` prompt (no chat template) and in a script file
LABELS = {"system": "System", "user": "User", "tool": "Tool result", "assistant": "Assistant"}


def template_messages(messages: list[Message]) -> list[Message]:
    """Messages any chat template takes: a tool result becomes a user message that says so (templates
    differ on tool roles; Gemma's takes user and assistant only) and consecutive messages of one role
    merge, so user and assistant alternate."""
    out: list[Message] = []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "tool":
            role, text = "user", f"Tool result: {text}"
        if out and out[-1]["role"] == role and role != "system":
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": role, "content": text})
    return out


class Conversation:
    """The conversation's prompt ids, turn by turn, as the model expects them."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.messages: list[Message] = []
        self.ids: list[int] = []  # without a template: every token so far (prompts and answers)
        self.stop = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        """EOS, and with a template the special token that ends an assistant's message (`<end_of_turn>`,
        `<|im_end|>`): the text the template writes right after an answer, when it is one added token."""
        stop = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        if self.templated:
            probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "MARK"}]
            text = self.tok.apply_chat_template(probe, tokenize=False)
            after = text[text.rindex("MARK") + 4:]
            ids = self.tok(after, add_special_tokens=False).input_ids if after else []
            if ids and ids[0] in set(self.tok.all_special_ids):
                stop.add(ids[0])
        return stop

    def prompt(self, turn: str | list[Message]) -> list[int]:
        """Add a turn; the ids of the whole prompt, ending where the assistant's answer starts."""
        new = [{"role": "user", "content": turn}] if isinstance(turn, str) else list(turn)
        self.messages += new
        if self.templated:
            text = self.tok.apply_chat_template(template_messages(self.messages), tokenize=False,
                                                add_generation_prompt=True)
            return list(self.tok(text, add_special_tokens=False).input_ids)
        if isinstance(turn, str):
            text = turn
        else:
            text = "\n".join(f"{LABELS[m['role']]}: {m['content']}" if m["role"] != "system" or self.ids
                             else m["content"] for m in new) + f"\n{LABELS['assistant']}:"
        first = not self.ids
        self.ids = self.ids + self.tok(("" if first else "\n") + text, add_special_tokens=first).input_ids
        return list(self.ids)

    def answered(self, answer: list[int]) -> str:
        """The answer's text, kept as the assistant's message (or its ids, without a template)."""
        text = self.tok.decode(answer, skip_special_tokens=True)
        if not self.templated:  # the next turn's label a base model began is not its answer
            text = min((text.split(f"\n{label}:")[0] for label in LABELS.values()), key=len)
        self.messages.append({"role": "assistant", "content": text.strip()})
        self.ids = self.ids + answer
        return text

    def ends(self, answer: list[int]) -> bool:
        """Without a template a base model would go on writing the next turn: stop at a blank line or
        at the next role label."""
        if self.templated:
            return False
        text = self.tok.decode(answer)
        return text.endswith("\n\n") or any(f"\n{label}:" in text for label in LABELS.values())


def reply(model, convo: Conversation, served, max_new_tokens: int) -> list[int]:
    """Greedy continuation from a served prompt, reading its cache; stops at a stop token or where
    `convo` says the answer ended."""
    out: list[int] = []
    logits = served.logits
    for _ in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        if nxt in convo.stop:
            break
        out.append(nxt)
        if convo.ends(out):
            break
        logits = forward(model, torch.tensor([[nxt]]), served.cache)[:, -1]
    return out


def turn_line(n: int, served, prompt_tokens: int, reply_text: str) -> str:
    """One line per turn: what the store gave and what the model ran. A replay installs the stored
    global KV of `reused` tokens, then runs the last of them again (`replayed`) to rebuild the sliding
    windows, before the tokens the turn added (`new`)."""
    replayed = served.computed_tokens - (prompt_tokens - served.reused_tokens)
    new = served.computed_tokens - replayed
    got = f"{served.reused_tokens:,} from the store" if served.reused_tokens else "nothing from the store"
    ran = f"ran {served.computed_tokens:,}"
    ran += f" = {replayed:,} replayed + {new:,} new" if served.kind is ServeKind.REPLAY else " new"
    return (f"[turn {n}] {served.kind:<6} prompt {prompt_tokens:,} tok: {got}, {ran}; "
            f"TTFT {served.ttft_s:.2f} s | {reply_text.strip()[:60]!r}")


def chat(model, tokenizer, server: PrefixServer, turns: Iterable[str | list[Message]],
         max_new_tokens: int = 32, forget_swa_before: set[int] = frozenset(), out=sys.stdout) -> list[dict]:
    """Run `turns` as one conversation; returns one record per turn."""
    convo = Conversation(tokenizer)
    log = []
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for n, turn in enumerate(turns, 1):
        if n in forget_swa_before:  # as if the SWA TTL ran out while the user was away
            server.store.swa_tier.clear()
        ids = convo.prompt(turn)
        if limit and len(ids) + max_new_tokens > limit:
            raise ValueError(f"turn {n}: the conversation is {len(ids):,} tokens; with {max_new_tokens} new "
                             f"tokens (--max-new-tokens) it exceeds the model's context of {limit:,} tokens")
        served = server.serve(ids)
        t0 = time.perf_counter()
        answer = reply(model, convo, served, max_new_tokens)
        decode_s = time.perf_counter() - t0
        text = convo.answered(answer)
        rec = {"turn": n, "kind": served.kind, "prompt_tokens": len(ids), "reused": served.reused_tokens,
               "computed": served.computed_tokens, "ttft_s": served.ttft_s, "decode_s": decode_s,
               "reply": text}
        log.append(rec)
        print(turn_line(n, served, len(ids), text), file=out, flush=True)
    return log
