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

from kvstrata_lab.bench import families, reasoning
from kvstrata_lab.bench.corpus import count, prose_and_continuation
from kvstrata_lab.bench.families import SPLITS
from kvstrata_lab.bench.haystack import place, special_tokens

RETRIEVAL = ("single", "multikey", "multivalue", "multiquery")
REASONING = ("vartrack",)
FIDELITY = ("fidelity",)
TASKS = RETRIEVAL + REASONING + FIDELITY  # the default set; the headline retrieval mean is over RETRIEVAL
#: run on request only: retrieval with other needle phrasings and lookalike distractors (a check
#: that gains hold beyond the generators above), a column of its own, outside the headline mean
LOOKALIKE = ("lookalike",)
#: run on request only: one question over the text families of `families` (sources, phrasings,
#: answer kinds, lengths spread below the nominal one); `calib` is what tuning and screening choose
#: on, `report` what claims are measured on, never the other way round
FAMILY_TASKS = SPLITS
#: run on request only: the reasoning families (`kvstrata_lab.bench.reasoning`), a step after the
#: lookup with a probe per needed fact; `calib-reason` chosen on, `report-reason` reported
REASON_TASKS = reasoning.SPLITS
KNOWN = TASKS + LOOKALIKE + FAMILY_TASKS + REASON_TASKS

CONTINUATION = 64  # tokens of a fidelity instance's scored continuation
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
    question_tokens: int = 0  # the longest question's tokens: context + question = the nominal length
    special_tokens: int = 0  # what the tokenizer adds in front of the context (Gemma's BOS)

    @property
    def uid(self) -> str:
        return f"{self.task}-{self.index}"


def _word(rng: random.Random) -> str:
    return rng.choice(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow", "violet",
                       "thunder", "lantern", "orchid", "glacier", "cobalt", "saffron", "willow", "ember",
                       "summit"])


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def make_instance(task: str, tokenizer, n_tokens: int, index: int, seed: int = 0,
                  haystack: str = "noise") -> Instance:
    """Instance `index` of `task` at `n_tokens` tokens; same inputs, same instance.

    A question task's context plus its longest question is exactly `n_tokens` fed tokens; a
    fidelity context is exactly `n_tokens` text tokens (its continuation is scored, not asked)."""
    if task == "fidelity":
        return _fidelity(tokenizer, n_tokens, index, seed)
    if task in FAMILY_TASKS:
        return _family_instance(task, tokenizer, n_tokens, index, seed)
    if task in REASON_TASKS:
        return _reason_instance(task, tokenizer, n_tokens, index, seed)
    rng, needles, questions, meta = draw(task, n_tokens, index, seed)
    reserve = question_tokens(tokenizer, questions)
    fractions = [rng.random() for _ in needles]
    try:
        ctx, depths = place(tokenizer, n_tokens - reserve, HEAD, needles, fractions, haystack, seed + index)
    except ValueError as exc:
        raise ValueError(f"{task} #{index} at {n_tokens} tokens (its question takes {reserve}): "
                         f"{exc}") from None
    return Instance(task, index, ctx, tuple(questions), meta={**meta, "depths": depths},
                    question_tokens=reserve, special_tokens=special_tokens(tokenizer))


def _family_instance(split: str, tokenizer, n_tokens: int, index: int, seed: int) -> Instance:
    """A family instance: its own head, source and phrasing, at its own drawn length (`meta["tokens"]`,
    at most `n_tokens`)."""
    fam, rng, tokens, needles, text, target, meta = families.draw(split, n_tokens, index, seed)
    questions = (Question(text, (target,), max_new_tokens=16),)
    reserve = question_tokens(tokenizer, questions)
    fractions = [rng.random() for _ in needles]
    try:
        ctx, depths = place(tokenizer, tokens - reserve, fam.head, needles, fractions, fam.source,
                            seed + index)
    except ValueError as exc:
        raise ValueError(f"{split} #{index} ({fam.name}) at {tokens} tokens: {exc}") from None
    return Instance(split, index, ctx, questions, meta={**meta, "depths": depths},
                    question_tokens=reserve, special_tokens=special_tokens(tokenizer))


def _reason_instance(split: str, tokenizer, n_tokens: int, index: int, seed: int) -> Instance:
    """A reasoning instance: the main question, then one probe per fact its step needs."""
    source, head, needles, main, target, probes, meta = reasoning.draw(split, n_tokens, index, seed)
    questions = (Question(main, (target,), max_new_tokens=16),
                 *(Question(text, (a,), role="probe", max_new_tokens=16) for text, a in probes))
    reserve = question_tokens(tokenizer, questions)
    rng = random.Random(f"{split}/place/{index}/{seed}")
    fractions = sorted(rng.random() for _ in needles)
    tokens = meta["tokens"]
    try:
        ctx, depths = place(tokenizer, tokens - reserve, head, needles, fractions, source, seed + index)
    except ValueError as exc:
        raise ValueError(f"{split} #{index} ({meta['reason_kind']}) at {tokens} tokens: {exc}") from None
    return Instance(split, index, ctx, questions, meta={**meta, "depths": depths},
                    question_tokens=reserve, special_tokens=special_tokens(tokenizer))


def draw(task: str, n_tokens: int, index: int, seed: int = 0):
    """(rng, needles, questions, meta) of a question task's instance, drawn before its haystack."""
    if task not in DRAW:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(KNOWN)})")
    rng = random.Random(f"{task}/{n_tokens}/{index}/{seed}")
    return (rng, *DRAW[task](rng, index))


def question_tokens(tokenizer, questions) -> int:
    """Tokens of the longest question, as it is fed after the context (no special tokens)."""
    return max((count(tokenizer, q.text) for q in questions), default=0)


def _single(rng: random.Random, index: int):
    key = _number(rng)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = Question("\nWhat is the pass key? Answer with the number.\nThe pass key is", (key,))
    return [needle], [question], {}


def _multikey(rng: random.Random, index: int):
    words = rng.sample(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow"], 4)
    nums = [_number(rng) for _ in words]
    needles = [f"The special magic number for {w} is: {n}. " for w, n in zip(words, nums)]
    rng.shuffle(needles)
    target = rng.randrange(len(words))
    q = Question(f"\nWhat is the special magic number for {words[target]}? Answer with the number.\n"
                 f"The special magic number for {words[target]} is:", (nums[target],))
    return needles, [q], {"distractors": len(words) - 1}


def _multivalue(rng: random.Random, index: int):
    word = _word(rng)
    nums = [_number(rng) for _ in range(3)]
    needles = [f"One of the special magic numbers for {word} is: {n}. " for n in nums]
    q = Question(f"\nWhat are all the special magic numbers for {word}? List them.\n"
                 f"The special magic numbers for {word} are:", tuple(nums), max_new_tokens=28)
    return needles, [q], {}


def _multiquery(rng: random.Random, index: int):
    words = rng.sample(["apple", "river", "silver", "falcon", "maple", "harbor", "copper", "meadow"], 2)
    nums = [_number(rng) for _ in words]
    needles = [f"The special magic number for {w} is: {n}. " for w, n in zip(words, nums)]
    # asked at once: the model must produce both numbers in one answer
    q = Question(f"\nWhat are the special magic numbers for {words[0]} and {words[1]}? "
                 f"Answer with both numbers.\nThe special magic numbers for {words[0]} and {words[1]} are:",
                 tuple(nums), max_new_tokens=24)
    return needles, [q], {}


#: phrasings of a lookalike fact (none is the "special magic number" of the tasks above)
PHRASINGS = ("The {obj} opens with the combination {n}. ", "To open the {obj}, dial {n}. ",
             "Remember that {n} is the combination for the {obj}. ",
             "Whoever needs the {obj} should dial the combination {n}. ")
SIDES, THINGS = ("north", "south", "east", "west"), ("vault", "locker", "gate", "safe")


def _lookalike(rng: random.Random, index: int):
    """One fact in one of several phrasings (by index) beside two distractors that share a word of
    its object (`north vault` beside `south vault` and `north locker`), each with its own number;
    the question asks for the target's in the first phrasing, whichever the facts use."""
    side, thing = rng.choice(SIDES), rng.choice(THINGS)
    others = [(rng.choice([s for s in SIDES if s != side]), thing),
              (side, rng.choice([t for t in THINGS if t != thing]))]
    objs = [f"{a} {b}" for a, b in [(side, thing), *others]]
    nums = rng.sample(range(10000, 100000), len(objs))
    template = PHRASINGS[index % len(PHRASINGS)]
    needles = [template.format(obj=o, n=n) for o, n in zip(objs, nums)]
    rng.shuffle(needles)
    target = objs[0]
    q = Question(f"\nWhat combination opens the {target}? Answer with the number.\n"
                 f"The {target} opens with the combination", (str(nums[0]),))
    return needles, [q], {"distractors": len(objs) - 1, "phrasing": index % len(PHRASINGS)}


def _var(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _vartrack(rng: random.Random, index: int):
    """A chain X1 = value, X2 = X1, ... with `hops` links (1..4, by index), in order through the context."""
    hops = 1 + index % 4
    names = [_var(rng) for _ in range(hops + 1)]
    value = _number(rng)
    needles = [f"VAR {names[0]} = {value}. "]
    needles += [f"VAR {names[i + 1]} = VAR {names[i]}. " for i in range(hops)]
    main = Question(f"\nQuestion: Follow the assignments. What is the value of VAR {names[-1]}? "
                    f"Answer with the number.\nAnswer: VAR {names[-1]} =", (value,))
    probes = [Question(f"\nQuestion: What is VAR {names[0]} assigned? Answer with the number.\n"
                       f"Answer: VAR {names[0]} =", (value,), role="probe")]
    probes += [Question(f"\nQuestion: Which variable is VAR {names[i + 1]} assigned from?\n"
                        f"Answer: VAR {names[i + 1]} = VAR", (names[i],), role="probe") for i in range(hops)]
    return needles, [main, *probes], {"hops": hops}


DRAW = {"single": _single, "multikey": _multikey, "multivalue": _multivalue, "multiquery": _multiquery,
        "vartrack": _vartrack, "lookalike": _lookalike}


def _fidelity(tokenizer, n_tokens, index, seed) -> Instance:
    """Natural prose: exactly `n_tokens` of context, then the 64 tokens after it, scored token by token."""
    ctx, cont = prose_and_continuation(tokenizer, n_tokens, CONTINUATION, seed + 1000 + index)
    return Instance("fidelity", index, ctx, (), continuation=cont, special_tokens=special_tokens(tokenizer))


def check_fed(inst: Instance, length: int, fed: int) -> None:
    """Refuse a context fed at `fed` tokens whose nominal length is `length` when they differ by more
    than the instance's question and special tokens: its row would report a length it did not run at.
    A family instance is checked against the length it drew (`meta["tokens"]`, at most `length`)."""
    length = inst.meta.get("tokens", length)
    slack = inst.question_tokens + inst.special_tokens
    if abs(length - fed) > slack:
        raise ValueError(f"{inst.uid} at length {length}: the context fed is {fed} tokens, "
                         f"{length - fed:+d} from its nominal length, more than its question and special "
                         f"tokens ({slack}) allow")


def score_answer(output: str, answers: tuple[str, ...]) -> float:
    """Fraction of expected strings found in the output (RULER's string match)."""
    return sum(a in output for a in answers) / len(answers)


def tag_failure(main_score: float, probe_scores: list[float], task: str) -> str | None:
    """None when the main answer is right; else `retrieval` (a needed fact is lost) or `reasoning`."""
    if main_score >= 1.0:
        return None
    if task in (*REASONING, *REASON_TASKS) and probe_scores and all(p >= 1.0 for p in probe_scores):
        return "reasoning"
    return "retrieval"
