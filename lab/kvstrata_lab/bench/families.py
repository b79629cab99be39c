"""Task families: needle instances over several text sources and phrasings, split in two disjoint
sets so that a claim is checked on text it was not chosen on.

A family is one haystack source, its own needle phrasings (several per family), its own question
paraphrases, an answer kind (numbers, codes, dates, names, quantities) and its own key words, from
which each instance draws a target plus one or two distractors that share no word with it, or (every
other round of the families) up to two that share one (`north bridge` beside `south bridge` and
`north tunnel`). *Calibration* families (`calib` task) are what
`kvstrata tune` and every screening choose on; *report* families (`report` task) are what a claim
is measured on. No source, phrasing, key word or seed is shared (`tests/lab/bench/test_families.py`).
An instance's length is drawn from [5/8, 1] of the cell's nominal length, so rows cover the range
below it, not one length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SPLITS = ("calib", "report")
LOW = 5 / 8  # an instance's length is drawn from [LOW * nominal, nominal]
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
FIRST = ("Dorothy", "Marcus", "Ingrid", "Tobias", "Helena", "Rafael", "Agnes", "Viktor", "Leona", "Cedric")
LAST = ("Whitfield", "Okafor", "Lindqvist", "Moreau", "Castellanos", "Abernathy", "Nakamura", "Brandt",
        "Fairbanks", "Delacroix")


@dataclass(frozen=True)
class Family:
    """One source and its phrasings. Templates take `{key}` and `{answer}`; a question's text ends
    where the answer should begin."""

    name: str
    split: str
    source: str  # a haystack kind (corpus.KINDS)
    head: str  # the text before the haystack
    needles: tuple[str, ...]
    questions: tuple[str, ...]
    answer: str  # number | code | date | name | quantity
    modifiers: tuple[str, ...]  # first word of a key
    nouns: tuple[str, ...]  # second word of a key


CALIB = (
    Family(
        "noise-magic", "calib", "noise",
        "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about it.\n",
        ("The special magic number for {key} is: {answer}. ",
         "Remember: the magic number of {key} is {answer}. "),
        ("\nWhat is the special magic number for {key}? Answer with the number.\n"
         "The special magic number for {key} is:",),
        "number", ("apple", "river", "silver", "falcon"), ("stone", "field", "tower", "garden")),
    Family(
        "reference-combination", "calib", "natural",
        "Below is an excerpt of a manual. Some facts are hidden in it; you will be asked about one.\n",
        ("The {key} opens with the combination {answer}. ", "To open the {key}, dial {answer}. ",
         "Remember that {answer} is the combination for the {key}. "),
        ("\nWhat combination opens the {key}? Answer with the number.\n"
         "The {key} opens with the combination",),
        "number", ("north", "south", "east", "west"), ("vault", "locker", "gate", "safe")),
    Family(
        "code-constant", "calib", "code-am",
        "# A source file. A few comments state facts; you will be asked about one.\n",
        ("# The magic constant of the {key} module is {answer}.\n",
         "# {key} module: magic constant {answer}\n"),
        ("\nWhat is the magic constant of the {key} module? Answer with the number.\n"
         "The magic constant of the {key} module is",),
        "number", ("alpha", "beta", "gamma", "delta"), ("parser", "loader", "router", "solver")),
    Family(
        "table-serial", "calib", "unicode-table",
        "A table of code points follows. A few rows name a serial code; you will be asked about one.\n",
        ("SERIAL | {key} | {answer}\n", "The serial code of the {key} is {answer}.\n"),
        ("\nWhat is the serial code of the {key}? Answer with the code.\nThe serial code of the {key} is",
         "\nWhich serial code does the {key} carry?\nSERIAL | {key} |"),
        "code", ("red", "green", "blue", "amber"), ("pump", "valve", "motor", "sensor")),
)

REPORT = (
    Family(
        "docstrings-date", "report", "docstrings",
        "Read the notes below. A few facts are hidden in them; you will be asked about one.\n",
        ("The {key} review is scheduled for {answer}. ",
         "Mark the calendar: the {key} review falls on {answer}. ",
         "Everyone agreed to hold the {key} review on {answer}. "),
        ("\nOn what date is the {key} review? Answer with the date.\nThe {key} review is scheduled for",
         "\nWhen will the {key} review take place? Give the date.\nThe {key} review falls on"),
        "date", ("lagoon", "canyon", "orchard", "quarry"), ("bridge", "tunnel", "depot", "pier")),
    Family(
        "code-token", "report", "code-nz",
        "# Some comments in this code record deploy tokens. Memorize them.\n",
        ("# The deploy token for the {key} service is {answer}.\n",
         "# {key} service -> deploy token {answer}\n",
         "# NOTE: {key} service deploys with token {answer}\n"),
        ("\nWhich deploy token does the {key} service use? Reply with the token.\n"
         "# The deploy token for the {key} service is",
         "\nGive the deploy token of the {key} service.\n# {key} service -> deploy token"),
        "code", ("billing", "search", "mailer", "ledger"), ("api", "worker", "cron", "proxy")),
    Family(
        "kv-owner", "report", "kv-dump",
        "Configuration dump. Remember who owns each cabinet.\n",
        ("owner.{key} = {answer}\n", "The {key} cabinet belongs to {answer}.\n",
         "{answer} holds the {key} cabinet.\n"),
        ("\nWho owns the {key} cabinet? Give the full name.\nowner.{key} =",
         "\nWhose is the {key} cabinet? Answer with a name.\nThe {key} cabinet belongs to"),
        "name", ("upper", "lower", "inner", "outer"), ("deck", "hall", "wing", "yard")),
    Family(
        "docstrings-weight", "report", "docstrings",
        "Shipping notes are mixed into this text. Keep track of the weights.\n",
        ("The {key} shipment weighs {answer} kilograms. ",
         "A weight of {answer} kilograms was logged for the {key} shipment. ",
         "Logged: {key} shipment, {answer} kg. "),
        ("\nHow many kilograms does the {key} shipment weigh? Answer with the number.\n"
         "The {key} shipment weighs",
         "\nWhat weight was recorded for the {key} shipment? Answer in kilograms.\nLogged: {key} shipment,"),
        "quantity", ("walnut", "timber", "cotton", "marble"), ("crate", "barrel", "pallet", "drum")),
)

FAMILIES = {f.name: f for f in CALIB + REPORT}


def of_split(split: str) -> tuple[Family, ...]:
    """The families of `calib` or `report`."""
    if split not in SPLITS:
        raise ValueError(f"unknown family split {split!r} (known: {', '.join(SPLITS)})")
    return CALIB if split == "calib" else REPORT


def family_of(split: str, index: int) -> Family:
    """Instance `index` of a split belongs to its families in turn."""
    fams = of_split(split)
    return fams[index % len(fams)]


def answer(kind: str, rng: random.Random) -> str:
    """A fresh answer of `kind`, as it is written in the needle (and must appear in the output)."""
    if kind == "number":
        return str(rng.randint(10000, 99999))
    if kind == "code":
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
        return f"{letters}-{rng.randint(1000, 9999)}"
    if kind == "date":
        return f"{rng.choice(MONTHS)} {rng.randint(2, 28)}"
    if kind == "name":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if kind == "quantity":
        return str(rng.randint(120, 9800))
    raise ValueError(f"unknown answer kind {kind!r}")


def ask(question: str, needle: str) -> str:
    """The question's paraphrased line, then the answer's lead-in: the target needle's own words up
    to its answer when they name the key first (`The {key} review is scheduled for`), else the
    question's own lead-in (a small model answers in the phrasing it read, not in a paraphrase)."""
    lead = needle.split("{answer}")[0]
    if "{key}" not in lead:
        return question
    line = question.rstrip().rsplit("\n", 1)[0]
    return f"{line}\n{lead.strip()}"


def draw(split: str, n_tokens: int, index: int, seed: int = 0):
    """(family, rng, tokens, needle texts, question text, answer, meta) of instance `index`: the
    seed string names the split and family, so no two splits ever share a random stream."""
    fam = family_of(split, index)
    rng = random.Random(f"{split}/{fam.name}/{n_tokens}/{index}/{seed}")
    tokens = rng.randint(int(LOW * n_tokens), n_tokens)
    mod, noun = rng.choice(fam.modifiers), rng.choice(fam.nouns)
    lookalike = (index // len(of_split(split))) % 2 == 1  # every other round of the families
    others = ([(m, noun) for m in fam.modifiers if m != mod] + [(mod, n) for n in fam.nouns if n != noun]
              if lookalike else [(m, n) for m in fam.modifiers for n in fam.nouns if m != mod and n != noun])
    keys = [(mod, noun), *rng.sample(others, rng.randint(0, 2) if lookalike else rng.randint(1, 2))]
    answers: list[str] = []
    while len(answers) < len(keys):  # distinct answers: a distractor's never counts as the target's
        a = answer(fam.answer, rng)
        if all(a not in b and b not in a for b in answers):
            answers.append(a)
    templates = [rng.choice(fam.needles) for _ in keys]
    needles = [t.format(key=f"{m} {n}", answer=a) for t, (m, n), a in zip(templates, keys, answers)]
    rng.shuffle(needles)
    q = rng.randrange(len(fam.questions))
    question = ask(fam.questions[q], templates[0]).format(key=f"{mod} {noun}")
    meta = {"text_family": fam.name, "split": split, "source": fam.source, "question_phrasing": q,
            "distractors": len(keys) - 1, "lookalike": lookalike, "tokens": tokens}
    return fam, rng, tokens, needles, question, answers[0], meta
