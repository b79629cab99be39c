"""Needles in a haystack: a context of exactly the length asked, in the tokens a model is fed.

The haystack text itself comes from `kvstrata_lab.bench.corpus` (noise sentences or natural prose, exact
lengths); here needles are inserted between its pieces at chosen depths, and the haystack's length
is adjusted until the whole context, head and needles and the tokenizer's special tokens included,
is exactly `n_tokens` (joining texts can merge tokens across a joint, so the parts' counts do not
simply add up).
"""

from __future__ import annotations

from kvstrata_lab.bench.corpus import TextShortfall, count, haystack

TRIES = 6  # budget corrections before the budgets around the last one are searched


def fed_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` as a model is fed it (the tokenizer's special tokens included)."""
    return len(tokenizer(text).input_ids)


def special_tokens(tokenizer) -> int:
    """Special tokens the tokenizer adds to every text (Gemma's BOS: 1; SmolLM2: 0)."""
    return len(tokenizer("").input_ids)


def place(
    tokenizer, n_tokens: int, head: str, needles: list[str], fractions: list[float], kind: str = "noise",
    seed: int = 0, tail: str = "",
) -> tuple[str, list[float]]:
    """(context, depths): `head`, then `kind` haystack with `needles` inserted in order at the piece
    boundaries nearest the relative depths `fractions`; the context followed by `tail` (a question
    fed in one piece with it) is exactly `n_tokens` fed tokens."""
    parts = [head, *needles, tail]
    fixed = special_tokens(tokenizer) + sum(count(tokenizer, p) for p in parts)
    if n_tokens < fixed:
        raise ValueError(
            f"{n_tokens} tokens cannot hold even the fixed text (head, needles, question): {fixed} tokens"
        )
    tried: dict[int, int] = {}

    def attempt(budget: int, shift: int = 0) -> tuple[str, list[float]] | None:
        pieces = haystack(kind, tokenizer, budget, seed)
        cuts = [min(len(pieces), max(0, round(f * len(pieces)) + shift)) for f in sorted(fractions)]
        out, last = [head], 0
        for cut, needle in zip(cuts, needles):
            out += pieces[last:cut] + [needle]
            last = cut
        text = "".join(out + pieces[last:])
        tried[budget] = fed_tokens(tokenizer, text + tail)
        return (text, [c / max(len(pieces), 1) for c in cuts]) if tried[budget] == n_tokens else None

    budget = n_tokens - fixed
    for _ in range(TRIES):
        if budget in tried or budget < 0:
            break
        if found := attempt(budget):
            return found
        budget += n_tokens - tried[budget]
    near = sorted(range(budget - 8, budget + 9), key=lambda b: abs(b - budget))
    for b in near:
        if b >= 0 and b not in tried and (found := attempt(b)):
            return found
    # some lengths no budget reaches (a joint merges tokens whichever piece ends there): move the
    # needles one piece over, so other joints form (only instances the above cannot place)
    for shift in (1, -1, 2, -2):
        for b in near:
            if b >= 0 and (found := attempt(b, shift)):
                return found
    closest = min(tried.values(), key=lambda g: abs(g - n_tokens))
    raise TextShortfall(
        f"{kind} context", n_tokens, closest, "no haystack length makes the joined context exact"
    )
