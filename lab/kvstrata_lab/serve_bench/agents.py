"""Scripted multi-turn agent conversations for `serve-bench`: each opens with a document of exactly
`context` tokens (its own, so a conversation's first turn is a miss), then alternates a user
question with a tool result; the assistant's real answers are appended by the client.

Deterministic: the same (seed, client, conversation) always gives the same script, so the
store-on and store-off phases replay the same conversations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstrata_lab.bench.corpus import exact_prefix, natural_paragraphs

QUESTIONS = (
    "Summarise what the document says about {w}.",
    "Which paragraph mentions {w}, and why does it matter here?",
    "List two facts about {w} from the document.",
    "Does the document contradict itself about {w}? Answer briefly.",
    "Explain {w} to a new team member in one sentence.",
    "What should the next tool call look up about {w}?",
)


@dataclass(frozen=True)
class Script:
    system: str
    turns: tuple[str, ...]

    def transcript(self, answers: list[str], upto: int) -> str:
        """The conversation as plain text up to turn `upto` (0-based), for models without a chat template."""
        text = self.system
        for i in range(upto + 1):
            text += f"\n\nUser: {self.turns[i]}\nAssistant:"
            if i < upto:
                text += " " + answers[i].strip()
        return text


class Scripts:
    """Conversation scripts measured in the serving model's tokens."""

    def __init__(self, tokenizer, context: int, turns: int, tool_tokens: int = 200, seed: int = 0):
        self.tok, self.context, self.turns, self.tool_tokens, self.seed = (
            tokenizer, context, turns, tool_tokens, seed,
        )
        self.paragraphs = natural_paragraphs(seed)

    def _text(self, rng: random.Random, tokens: int, what: str) -> str:
        """Random paragraphs cut to exactly `tokens` tokens (without special tokens)."""
        picked, size = [], 0
        while size < tokens * 6:  # characters; at least ~1.5 per token in any tokenizer here
            p = rng.choice(self.paragraphs)
            picked.append(p)
            size += len(p)
        return exact_prefix(self.tok, "\n\n".join(picked), tokens, what)[0]

    def script(self, client: int, conversation: int) -> Script:
        rng = random.Random(f"{self.seed}-{client}-{conversation}")
        doc = self._text(rng, self.context, "agent document")
        words = [w.strip(".,;:()\"'") for w in doc.split() if len(w) > 6] or ["the document"]
        # the session id first: no two conversations share a block, so each first turn is a miss
        system = f"[{client}.{conversation}] You are an agent. Work only from this document:\n\n{doc}"
        turns = []
        for t in range(self.turns):
            if t % 2 == 0:
                turns.append(rng.choice(QUESTIONS).format(w=rng.choice(words)))
            else:
                turns.append("Tool result:\n" + self._text(rng, self.tool_tokens, "tool result"))
        return Script(system, tuple(turns))

    def probe_document(self, tokens: int) -> str:
        """One long prompt of `tokens` tokens for the single-client cold / warm / replay probe."""
        return self._text(random.Random(f"{self.seed}-probe"), tokens, "probe document")

    def document(self, key: str, tokens: int) -> str:
        """Paragraphs of exactly `tokens` tokens, drawn by `key` (distinct keys: distinct prompts)."""
        return self._text(random.Random(f"{self.seed}-{key}"), tokens, f"document {key}")
