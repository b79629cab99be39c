"""Reasoning families: a step after the lookup, with a probe per needed fact, so that every wrong answer
is tagged from data -- `retrieval` (a probe failed: a fact the step needs is lost) or `reasoning`
(every probe passed, the step failed).

Four kinds, each in a calibration and a report family (tasks `calib-reason` / `report-reason`; own
sources, phrasings, key words and seeds, as `kvstrata_lab.bench.families`):
- two-hop: X is led by P; P works at C; "where does the leader of X work?" -> C;
- larger: two quantities; "what is the larger one?" -> the larger number;
- sum: two small counts; "how many together?" -> their sum;
- track: `a = v`, later `b = a`, later `a = w` (code, in that order); "what is b?" -> v.
A kind counts on a model only where bf16 answers >= `COUNTS_FROM` of it (`kvstrata report`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstrata_lab.bench.families import LOW

SPLITS = ("calib-reason", "report-reason")
KINDS = ("two-hop", "larger", "sum", "track")
COUNTS_FROM = 0.6  # the share of a kind bf16 must answer for the kind to count on that model


@dataclass(frozen=True)
class Words:
    """One split's vocabulary and haystack sources (disjoint between the splits)."""

    sources: tuple[str, ...]  # haystack kind per reasoning kind
    head: str
    things: tuple[str, ...]  # keys for two-hop groups, quantities and counts
    people: tuple[str, ...]
    places: tuple[str, ...]
    variables: tuple[str, ...]


WORDS = {
    "calib-reason": Words(
        ("noise", "natural", "noise", "natural"),
        "Some facts are hidden in the text below. Read carefully; you will be asked a question about them.\n",
        ("heron", "quartz", "bramble", "kestrel", "juniper", "basalt"),
        ("Oswin Hale", "Greta Voss", "Silas Crane", "Mira Quill", "Anton Rusk", "Lena Dorsey"),
        ("Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Dakar"),
        ("acc", "tmp", "cur", "buf"),
    ),
    "report-reason": Words(
        ("docstrings", "kv-dump", "docstrings", "code-nz"),
        "Notes from the archive follow. Keep track of the facts in them; a question comes at the end.\n",
        ("atlas", "beacon", "cinder", "delta", "ember", "fjord"),
        ("Ruth Calloway", "Ivan Petrov", "Nadia Hassan", "Owen Marsh", "Priya Raman", "Tomas Berg"),
        ("Toronto", "Nairobi", "Munich", "Osaka", "Santiago", "Cairo"),
        ("total", "count", "level", "score"),
    ),
}


@dataclass(frozen=True)
class Fact:
    text: str
    probe: str  # the probe question, ending where its answer begins
    answer: str


#: two-hop phrasings per split: noun, first hop, role, second hop, its probe's question
HOPS = {
    True: ("ship", "is captained by", "captain", "was born in", "In which city was {p} born?"),
    False: ("project", "is led by", "leader", "works in", "In which city does {p} work?"),
}


def two_hop(w: Words, rng: random.Random, calib: bool):
    noun, lead, role, hop, ask = HOPS[calib]
    things, people, places = rng.sample(w.things, 2), rng.sample(w.people, 2), rng.sample(w.places, 2)
    facts = []
    for t, p, c in zip(things, people, places):
        who = f"\nWho is the {role} of the {t} {noun}? Answer with the name.\nThe {t} {noun} {lead}"
        facts.append(Fact(f"The {t} {noun} {lead} {p}. ", who, p))
        facts.append(Fact(f"{p} {hop} {c}. ", f"\n{ask.format(p=p)} Answer with the city.\n{p} {hop}", c))
    main = (f"\n{ask.format(p=f'the {role} of the {things[0]} {noun}')} Answer with the city.\n"
            f"The {role} of the {things[0]} {noun} {hop}")
    return facts, [facts[0], facts[1]], main, places[0]


def larger(w: Words, rng: random.Random, calib: bool):
    things = rng.sample(w.things, 3)
    values = rng.sample(range(120, 990), 3)
    unit, noun = ("litres", "tank") if calib else ("kilograms", "crate")
    ask = "\nHow many {unit} does the {t} {noun} hold? Answer with the number.\nThe {t} {noun} holds"
    facts = [Fact(f"The {t} {noun} holds {v} {unit}. ", ask.format(unit=unit, t=t, noun=noun), str(v))
             for t, v in zip(things, values)]
    main = (f"\nOf the {things[0]} {noun} and the {things[1]} {noun}, which holds more, and how many {unit}? "
            f"Answer with the larger number.\nThe larger of the two holds")
    return facts, facts[:2], main, str(max(values[:2]))


def add(w: Words, rng: random.Random, calib: bool):
    things = rng.sample(w.things, 3)
    values = [rng.randint(11, 49) for _ in things]
    unit, noun = ("coins", "purse") if calib else ("tickets", "booth")
    facts = [Fact(f"The {t} {noun} has {v} {unit}. ",
                  f"\nHow many {unit} does the {t} {noun} have? Answer with the number.\nThe {t} {noun} has",
                  str(v)) for t, v in zip(things, values)]
    main = (f"\nHow many {unit} do the {things[0]} {noun} and the {things[1]} {noun} have together? "
            f"Answer with the number.\nTogether they have")
    return facts, facts[:2], main, str(values[0] + values[1])


def track(w: Words, rng: random.Random, calib: bool):
    a, b = rng.sample(w.variables, 2)
    a, b = f"{a}_{rng.choice(w.things)}", f"{b}_{rng.choice(w.things)}"
    first, later = rng.sample(range(100, 999), 2)
    c = "#" if not calib else "//"
    facts = [Fact(f"\n{a} = {first}\n", f"\n{c} What value is {a} first set to? Answer with the number.\n"
                                         f"{a} =", str(first)),
             Fact(f"\n{b} = {a}\n", f"\n{c} Which variable is {b} assigned from? Answer with its name.\n"
                                     f"{b} =", a),
             Fact(f"\n{a} = {later}\n", "", str(later))]
    main = (f"\n{c} The three lines above ran in order. What is the value of {b} now? Answer with the "
            f"number.\n{b} ==")
    return facts, facts[:2], main, str(first)


MAKERS = {"two-hop": two_hop, "larger": larger, "sum": add, "track": track}


def draw(split: str, n_tokens: int, index: int, seed: int = 0):
    """(kind, source, head, needles in context order, main question text, answer, probes [(text,
    answer)], meta) of instance `index`: the kinds in turn, lengths drawn from [LOW, 1] of nominal."""
    if split not in SPLITS:
        raise ValueError(f"unknown reasoning split {split!r} (known: {', '.join(SPLITS)})")
    kind = KINDS[index % len(KINDS)]
    w = WORDS[split]
    rng = random.Random(f"{split}/{kind}/{n_tokens}/{index}/{seed}")
    tokens = rng.randint(int(LOW * n_tokens), n_tokens)
    facts, needed, main, answer = MAKERS[kind](w, rng, split.startswith("calib"))
    if kind != "track":  # facts in any order; a track's lines run in order
        rng.shuffle(facts)
    probes = [(f.probe, f.answer) for f in needed]
    meta = {"text_family": f"{split}-{kind}", "split": split, "reason_kind": kind,
            "source": w.sources[KINDS.index(kind)], "tokens": tokens}
    return w.sources[KINDS.index(kind)], w.head, [f.text for f in facts], main, answer, probes, meta
