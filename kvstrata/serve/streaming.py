"""Generated token ids -> text deltas for streaming, honouring stop sequences.

Invariant: the deltas emitted, concatenated, are a prefix of the final text, and the final text
never contains a stop sequence (OpenAI semantics: output ends before it). Text that may still be
a partial UTF-8 character or the start of a stop sequence is held back until it cannot be.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()):
        self.decode = decode
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop sequence once one is seen)
        self.emitted = 0  # characters of `text` already handed out

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; (new text safe to emit, whether a stop sequence ended the output)."""
        self.ids.append(token)
        self.text = self.decode(self.ids)
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return self._emit(len(self.text)), True
        safe = len(self.text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD
        safe -= self._held(self.text[:safe])
        return self._emit(safe), False

    def finish(self) -> str:
        """The rest of the text, once generation has ended."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta

    def _first_stop(self) -> int | None:
        if not self.stops:
            return None
        start = max(0, self.emitted - max(map(len, self.stops)))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop sequence."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
