"""Text of an exact length in a tokenizer's tokens: RULER's noise sentences, natural prose shipped
with Python itself (`pydoc_data.topics`), or the standard library's code, docstrings and tables
(`sources`).

Every source here returns exactly the number of tokens asked: it repeats its text until there is
enough, then cuts. Where the text cannot be cut at exactly that count it raises `TextShortfall`,
naming the source and how far it fell short; no caller ever gets a silently shorter text. Lengths
count tokens without special tokens, except `natural_ids`, which returns the ids a model is fed.
"""

from __future__ import annotations

from kvstrata_lab.bench import sources
from kvstrata_lab.bench.sources import natural_paragraphs

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KINDS = ("noise", "natural", *sources.KINDS)
MARGIN = 16  # tokens read past a cut, so that the tokens before it are those of the longer text
WINDOW = 4  # token boundaries tried on each side of a cut whose count shifts when the text ends there


class TextShortfall(ValueError):
    """A text source could not deliver the number of tokens asked."""

    def __init__(self, source: str, asked: int, got: int, why: str):
        super().__init__(f"{source}: asked for {asked} tokens, got {got}: {why}")
        self.source, self.asked, self.got = source, asked, got


def units(kind: str, seed: int = 0) -> list[str]:
    """The pieces a haystack repeats, in order: the noise sentences, or paragraphs each ending in a
    newline."""
    if kind == "noise":
        return [NOISE]
    if kind == "natural":
        return [p + "\n" for p in natural_paragraphs(seed)]
    if kind in sources.KINDS:
        return sources.pieces(kind, seed)
    raise ValueError(f"unknown haystack {kind!r} (known: {', '.join(KINDS)})")


def count(tokenizer, text: str) -> int:
    """Tokens of `text` without special tokens."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def long_enough(tokenizer, unit: list[str], n_tokens: int) -> list[str]:
    """`unit`'s pieces in order, repeated as needed, until they hold at least `n_tokens` + MARGIN tokens."""
    per = max(1.0, count(tokenizer, "".join(unit[:8])) / min(8, len(unit)))
    pieces: list[str] = []
    have = 0
    while have < n_tokens + MARGIN:
        add = int((n_tokens + MARGIN - have) / per) + 1
        pieces += [unit[(len(pieces) + j) % len(unit)] for j in range(add)]
        have = count(tokenizer, "".join(pieces))
    return pieces


def exact_prefix(tokenizer, text: str, n_tokens: int, source: str) -> tuple[str, int]:
    """(`text` cut to exactly `n_tokens` tokens, characters of `text` it consumed).

    The cut falls on a token boundary of `text`'s own tokenization. A character the tokenizer
    splits into several tokens (a byte-level tokenizer's curly quote) cannot be cut inside: when
    one straddles the cut, it is dropped and the text goes on after it. The prefix and `text` agree
    up to the cut, except for such a dropped character."""
    if n_tokens == 0:
        return "", 0
    dropped = ""
    for _ in range(8):
        spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(spans) < n_tokens:
            raise TextShortfall(source, n_tokens, len(spans), "the text given is too short")
        for k in sorted(range(-WINDOW, WINDOW + 1), key=abs):
            j = n_tokens - 1 + k
            if 0 <= j < len(spans) and count(tokenizer, text[: spans[j][1]]) == n_tokens:
                return text[: spans[j][1]], spans[j][1] + len(dropped)
        start, end = spans[n_tokens - 1]
        if end - start != 1 or not text[start].isascii():
            start, end = _char_at(text, start, end)
        dropped += text[start:end]
        text = text[:start] + text[end:]
    got = count(tokenizer, text[: spans[n_tokens - 1][1]])
    raise TextShortfall(source, n_tokens, got, "no cut of the text gives exactly that many tokens")


def _char_at(text: str, start: int, end: int) -> tuple[int, int]:
    """The span of the first non-ASCII character in `text[start:end]` (or of `text[start]`)."""
    for i in range(start, max(end, start + 1)):
        if not text[i].isascii():
            return i, i + 1
    return start, start + 1


def haystack(kind: str, tokenizer, n_tokens: int, seed: int = 0) -> list[str]:
    """Haystack pieces (sentences or paragraphs, in order, the last one cut) whose concatenation is
    exactly `n_tokens` tokens under `tokenizer`."""
    if n_tokens < 0:
        raise ValueError(f"{kind} haystack: asked for {n_tokens} tokens")
    if n_tokens == 0:
        return []
    pieces = long_enough(tokenizer, units(kind, seed), n_tokens)
    joined = "".join(pieces)
    text, _ = exact_prefix(tokenizer, joined, n_tokens, f"{kind} haystack")
    out, pos = [], 0
    for p in pieces:  # whole pieces while the cut text still agrees with them, then the rest
        if pos + len(p) > len(text) or text[pos : pos + len(p)] != p:
            break
        out.append(p)
        pos += len(p)
    return out + ([text[pos:]] if pos < len(text) else [])


def prose_and_continuation(tokenizer, n_tokens: int, n_next: int, seed: int = 0) -> tuple[str, str]:
    """Natural prose of exactly `n_tokens` tokens, and the `n_next` tokens that follow it in the text."""
    joined = "".join(long_enough(tokenizer, units("natural", seed), n_tokens + n_next))
    head, used = exact_prefix(tokenizer, joined, n_tokens, "natural prose")
    tail, _ = exact_prefix(tokenizer, joined[used:], n_next, "natural continuation")
    return head, tail


def natural_ids(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` token ids of natural prose as a model is fed them (the tokenizer's special
    tokens first)."""
    joined = "".join(long_enough(tokenizer, units("natural", seed), n_tokens))
    ids = tokenizer(joined).input_ids[:n_tokens]
    if len(ids) != n_tokens:
        raise TextShortfall("natural ids", n_tokens, len(ids), "the text repeated was still too short")
    return ids
