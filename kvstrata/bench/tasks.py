"""Benchmark tasks, generated deterministically from a seed at a length in the model's tokens.

Every instance is a context plus questions asked after it. Retrieval tasks (RULER-style needles)
ask one question; variable tracking asks the chain question plus one single-hop probe per link,
so that a failure is tagged from data: `retrieval` (a probe failed: a link itself is lost) or
`reasoning` (every probe passed, the chain broke). Fidelity instances carry a natural-text
continuation scored by KL / top-1 / perplexity against the uncompressed cache.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from kvstrata.bench.haystack import filler

RETRIEVAL = ("single", "multikey", "multivalue", "multiquery")
REASONING = ("vartrack",)
FIDELITY = ("fidelity",)
TASKS = RETRIEVAL + REASONING + FIDELITY

HEAD = ("There is important information hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about it.\n")


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]  # every string must appear in the output for full credit
    role: str = "main"  # "main" or "probe"
    max_new_tokens: int = 12


@dataclass(frozen=True)
class Instance:
    task: str
    index: int
    context: str
    questions: tuple[Question, ...] = ()
    continuation: str = ""  # fidelity only
    meta: dict = field(default_factory=dict)

    @property
    def uid(self) -> str:
        return f"{self.task}-{self.index}"


def _word(rng: random.Random) -> str:
    return rng.choice(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow", "violet",
                       "thunder", "lantern", "orchid", "glacier", "cobalt", "saffron", "willow", "ember", "summit"])


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _place(tokenizer, n_tokens: int, needles: list[str], rng: random.Random, haystack: str, seed: int) -> tuple[str, list[float]]:
    """Insert `needles` (in order) at random depths into ~`n_tokens` of haystack; return text and depths."""
    count = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    budget = n_tokens - count(HEAD) - sum(count(n) for n in needles) - 60
    pieces = filler(haystack, max(budget, 10), count, seed)
    cuts = sorted(rng.randint(0, len(pieces)) for _ in needles)
    out, last = [HEAD], 0
    for cut, needle in zip(cuts, needles):
        out += pieces[last:cut] + [needle]
        last = cut
    out += pieces[last:]
    return "".join(out), [c / max(len(pieces), 1) for c in cuts]


def make_instance(task: str, tokenizer, n_tokens: int, index: int, seed: int = 0, haystack: str = "noise") -> Instance:
    """Instance `index` of `task` at ~`n_tokens` context tokens; same inputs, same instance."""
    rng = random.Random(f"{task}/{n_tokens}/{index}/{seed}")
    if task == "single":
        key = _number(rng)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        ctx, depths = _place(tokenizer, n_tokens, [needle], rng, haystack, seed + index)
        q = Question("\nWhat is the pass key? Answer with the number.\nThe pass key is", (key,))
        return Instance(task, index, ctx, (q,), meta={"depths": depths})
    if task == "multikey":
        words = rng.sample(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow"], 4)
        nums = [_number(rng) for _ in words]
        needles = [f"The special magic number for {w} is: {n}. " for w, n in zip(words, nums)]
        rng.shuffle(needles)
        ctx, depths = _place(tokenizer, n_tokens, needles, rng, haystack, seed + index)
        target = rng.randrange(len(words))
        q = Question(f"\nWhat is the special magic number for {words[target]}? Answer with the number.\n"
                     f"The special magic number for {words[target]} is:", (nums[target],))
        return Instance(task, index, ctx, (q,), meta={"depths": depths, "distractors": len(words) - 1})
    if task == "multivalue":
        word = _word(rng)
        nums = [_number(rng) for _ in range(3)]
        needles = [f"One of the special magic numbers for {word} is: {n}. " for n in nums]
        ctx, depths = _place(tokenizer, n_tokens, needles, rng, haystack, seed + index)
        q = Question(f"\nWhat are all the special magic numbers for {word}? List them.\n"
                     f"The special magic numbers for {word} are:", tuple(nums), max_new_tokens=28)
        return Instance(task, index, ctx, (q,), meta={"depths": depths})
    if task == "multiquery":
        words = rng.sample(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow"], 2)
        nums = [_number(rng) for _ in words]
        needles = [f"The special magic number for {w} is: {n}. " for w, n in zip(words, nums)]
        ctx, depths = _place(tokenizer, n_tokens, needles, rng, haystack, seed + index)
        # asked at once: the model must produce both numbers in one answer
        q = Question(f"\nWhat are the special magic numbers for {words[0]} and {words[1]}? "
                     f"Answer with both numbers.\nThe special magic numbers for {words[0]} and {words[1]} are:",
                     tuple(nums), max_new_tokens=24)
        return Instance(task, index, ctx, (q,), meta={"depths": depths})
    if task == "vartrack":
        return _vartrack(tokenizer, n_tokens, index, rng, haystack, seed)
    if task == "fidelity":
        return _fidelity(tokenizer, n_tokens, index, seed)
    raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")


def _var(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _vartrack(tokenizer, n_tokens, index, rng, haystack, seed) -> Instance:
    """A chain X1 = value, X2 = X1, ... with `hops` links (1..4, by index), in order through the context."""
    hops = 1 + index % 4
    names = [_var(rng) for _ in range(hops + 1)]
    value = _number(rng)
    needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i + 1]} = VAR {names[i]}. " for i in range(hops)]
    ctx, depths = _place(tokenizer, n_tokens, needles, rng, haystack, seed + index)
    main = Question(f"\nQuestion: Follow the assignments. What is the value of VAR {names[-1]}? Answer with the number.\n"
                    f"Answer: VAR {names[-1]} =", (value,))
    probes = [Question(f"\nQuestion: What is VAR {names[0]} assigned? Answer with the number.\nAnswer: VAR {names[0]} =",
                       (value,), role="probe")]
    probes += [Question(f"\nQuestion: Which variable is VAR {names[i + 1]} assigned from?\nAnswer: VAR {names[i + 1]} = VAR",
                        (names[i],), role="probe") for i in range(hops)]
    return Instance("vartrack", index, ctx, (main, *probes), meta={"hops": hops, "depths": depths})


def _fidelity(tokenizer, n_tokens, index, seed) -> Instance:
    """Natural prose: ~`n_tokens` of context, then a 64-token continuation scored token by token."""
    from kvstrata.bench.haystack import natural_paragraphs

    paras = natural_paragraphs(seed + 1000 + index)
    text = "\n".join(paras)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < n_tokens + 64:
        text = (text + "\n") * (1 + (n_tokens + 64) // max(len(ids), 1))
        ids = tokenizer(text, add_special_tokens=False).input_ids
    ctx = tokenizer.decode(ids[:n_tokens])
    cont = tokenizer.decode(ids[n_tokens : n_tokens + 64])
    return Instance("fidelity", index, ctx, (), continuation=cont)


def score_answer(output: str, answers: tuple[str, ...]) -> float:
    """Fraction of expected strings found in the output (RULER's string match)."""
    return sum(a in output for a in answers) / len(answers)


def tag_failure(main_score: float, probe_scores: list[float], task: str) -> str | None:
    """None when the main answer is right; else `retrieval` (a needed fact is lost) or `reasoning`."""
    if main_score >= 1.0:
        return None
    if task in REASONING and probe_scores and all(p >= 1.0 for p in probe_scores):
        return "reasoning"
    return "retrieval"
