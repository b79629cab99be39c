"""Tokenize a conversation's text without tokenizing again what earlier turns already sent.

A Hugging Face tokenizer cuts its input at its added tokens (`<|im_start|>`, `<start_of_turn>`,
Gemma's newline runs) before anything else, and tokenizes each piece between them on its own. So the
ids of a text are the ids of its pieces in order, and a piece seen before (an earlier turn, the
system prompt) needs no tokenizing: `SegmentTokenizer` remembers pieces' ids (LRU) and tokenizes only
new pieces, in one batch call. Where that identity cannot hold -- an added token that strips
whitespace around it or matches on normalized text -- or where the tokenizer disagrees with it on
probe texts at start, it tokenizes whole texts as before: the cache changes speed, never ids.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

log = logging.getLogger("kvstrata.serve")

#: texts the segmented path must tokenize exactly as the tokenizer does before it is used
PROBES = (
    "Hello, world!  Two  spaces,\ttabs,\n\nblank lines\n and ünïcödé — ok.",
    " leading space\nline two\r\nline three   \n\n\n",
    "x" * 40 + " 12345 67.89 def f(a, b):\n    return a + b\n",
)


class SegmentTokenizer:
    """`ids(text)` == `tok(text, add_special_tokens=False).input_ids`, remembering pieces between added
    tokens, least recently used first out once they hold `capacity` ids (a piece counts its ids and a
    quarter of its characters). Not thread-safe: the caller holds the tokenizer's lock."""

    def __init__(self, tok, capacity: int = 1 << 21):
        self.tok, self.capacity = tok, capacity
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._held = 0
        self.stats = {"pieces": 0, "tokenized": 0}
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        self.added = {t.content: i for i, t in added.items()}
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        # longest first: at each position the longest added token wins, as the tokenizer matches them
        self._split = re.compile("|".join(re.escape(c) for c in sorted(self.added, key=len, reverse=True))
                                 ) if self.added else None
        self.enabled = plain and self._agrees()
        if not self.enabled:
            log.info("kvstrata: prompts are tokenized whole (the tokenizer's pieces are not independent)")
        # the special tokens the tokenizer adds around one text (Gemma's <bos>), if only in front
        self.prefix = list(tok("").input_ids)
        self.prefixed = self.enabled and all(list(tok(t).input_ids) == self.prefix + self.ids(t)
                                             for t in PROBES)
        self.stats = {"pieces": 0, "tokenized": 0}

    def _whole(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def _agrees(self) -> bool:
        specials = "".join(list(self.added)[:8])
        texts = [*PROBES, specials.join(PROBES), PROBES[0] + specials + PROBES[1]]
        try:
            ok = all(self._segmented(t) == self._whole(t) for t in texts)
        except Exception:  # a tokenizer this cannot drive: tokenize whole texts
            ok = False
        self._pieces.clear()
        self._held = 0
        return ok

    def ids(self, text: str) -> list[int]:
        """`text`'s ids, without the tokenizer's special tokens."""
        return self._segmented(text) if self.enabled else self._whole(text)

    def ids_with_specials(self, text: str) -> list[int]:
        """`tok(text).input_ids`: with the special tokens the tokenizer adds."""
        return self.prefix + self._segmented(text) if self.prefixed else list(self.tok(text).input_ids)

    def _segmented(self, text: str) -> list[int]:
        parts, at = [], 0
        for m in self._split.finditer(text) if self._split else ():
            if m.start() > at:
                parts.append(text[at:m.start()])
            parts.append(m.group())
            at = m.end()
        if at < len(text):
            parts.append(text[at:])
        known: dict[str, tuple[int, ...]] = {}
        for p in parts:
            if p not in self.added and p not in known and p in self._pieces:
                known[p] = self._pieces[p]
                self._pieces.move_to_end(p)
        new = list(dict.fromkeys(p for p in parts if p not in self.added and p not in known))
        if new:
            for piece, ids in zip(new, self.tok(new, add_special_tokens=False).input_ids):
                known[piece] = tuple(ids)
                self._remember(piece, known[piece])
        self.stats["pieces"] += len(parts)
        self.stats["tokenized"] += len(new)
        out: list[int] = []
        for p in parts:
            if p in self.added:
                out.append(self.added[p])
            else:
                out.extend(known[p])
        return out

    def _remember(self, piece: str, ids: tuple[int, ...]) -> None:
        self._pieces[piece] = ids
        self._held += _weight(piece, ids)
        while self._held > self.capacity:
            old, old_ids = self._pieces.popitem(last=False)
            self._held -= _weight(old, old_ids)


def _weight(piece: str, ids: tuple[int, ...]) -> int:
    return len(ids) + len(piece) // 4
