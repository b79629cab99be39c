"""`kvstrata chat`: a multi-turn session over the persistent store, showing per turn whether the
prompt was a hit, a bounded replay or a miss, and its time to first token."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

import torch

from kvstrata.hf.run import forward
from kvstrata.place.prefix_server import PrefixServer


def reply(model, tokenizer, served, max_new_tokens: int) -> list[int]:
    """Greedy continuation from a served prompt, reading its cache; stops at EOS or a blank line."""
    out: list[int] = []
    logits = served.logits
    for _ in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        if nxt == tokenizer.eos_token_id:
            break
        out.append(nxt)
        if tokenizer.decode(out).endswith("\n\n"):
            break
        logits = forward(model, torch.tensor([[nxt]]), served.cache)[:, -1]
    return out


def chat(model, tokenizer, server: PrefixServer, turns: Iterable[str], max_new_tokens: int = 32,
         forget_swa_before: set[int] = frozenset(), out=sys.stdout) -> list[dict]:
    """Run `turns` as one conversation; returns one record per turn."""
    history: list[int] = []
    log = []
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for n, text in enumerate(turns, 1):
        if n in forget_swa_before:  # as if the SWA TTL ran out while the user was away
            server.store.swa_tier.clear()
        ids = history + tokenizer(("" if not history else "\n") + text,
                                  add_special_tokens=not history).input_ids
        if limit and len(ids) + max_new_tokens > limit:
            raise ValueError(f"turn {n}: the conversation is {len(ids):,} tokens; with {max_new_tokens} new "
                             f"tokens (--max-new-tokens) it exceeds the model's context of {limit:,} tokens")
        served = server.serve(ids)
        t0 = time.perf_counter()
        answer = reply(model, tokenizer, served, max_new_tokens)
        decode_s = time.perf_counter() - t0
        history = ids + answer
        rec = {"turn": n, "kind": served.kind, "prompt_tokens": len(ids), "reused": served.reused_tokens,
               "computed": served.computed_tokens, "ttft_s": served.ttft_s, "decode_s": decode_s,
               "reply": tokenizer.decode(answer)}
        log.append(rec)
        print(f"[turn {n}] {served.kind:<6} prompt {len(ids):>6} tok, reused {served.reused_tokens:>6}, "
              f"computed {served.computed_tokens:>6}, TTFT {served.ttft_s:6.2f} s | "
              f"{rec['reply'].strip()[:60]!r}",
              file=out, flush=True)
    return log
