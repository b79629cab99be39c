"""The single-needle passkey prompt: a number hidden at a chosen depth in a long haystack."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstrata_lab.bench.haystack import place

# Phrased so that base models (Gemma-3-270M) answer with the number, not a paraphrase.
QUESTION = "\nWhat is the pass key? Answer with the number.\nThe pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    context: str
    question: str
    answer: str
    depth: float


def passkey_prompt(
    tokenizer, n_tokens: int, depth: float = 0.5, seed: int = 0, haystack: str = "noise"
) -> PasskeyPrompt:
    """The needle at relative `depth` in a context that, with the question after it, is exactly
    `n_tokens` tokens as the model is fed them."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    head = (
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it.\n"
    )
    context, _ = place(tokenizer, n_tokens, head, [needle], [depth], haystack, seed, tail=QUESTION)
    return PasskeyPrompt(context, QUESTION, key, depth)
