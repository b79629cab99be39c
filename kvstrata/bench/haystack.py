"""Haystack text: RULER's repeated noise sentences, or natural text shipped with Python itself."""

from __future__ import annotations

import random

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def natural_paragraphs(seed: int = 0) -> list[str]:
    """Paragraphs of real English prose from the standard library's `pydoc_data.topics`."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for p in topics[key].split("\n\n"):
            p = " ".join(p.split())
            if len(p) > 200 and p[0].isalpha() and not p.startswith(("Changed in", "New in", "Added in")):
                paras.append(p)
    random.Random(seed).shuffle(paras)
    return paras


def filler(kind: str, n_tokens: int, count_tokens, seed: int = 0) -> list[str]:
    """Sentences/paragraphs whose concatenation is about `n_tokens` long under `count_tokens`."""
    if kind == "noise":
        unit = [NOISE]
    elif kind == "natural":
        unit = natural_paragraphs(seed)
    else:
        raise ValueError(f"unknown haystack {kind!r} (known: noise, natural)")
    per = max(1, count_tokens("".join(unit[:8])) / min(8, len(unit)))
    out: list[str] = []
    total = 0.0
    i = 0
    while total < n_tokens:
        piece = unit[i % len(unit)] if kind == "noise" else unit[i % len(unit)] + "\n"
        out.append(piece)
        total += per
        i += 1
    return out


def natural_ids(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """About `n_tokens` token ids of natural prose (with the tokenizer's special tokens), cut to `n_tokens`."""
    count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    return tokenizer("".join(filler("natural", n_tokens + 64, count, seed))).input_ids[:n_tokens]
