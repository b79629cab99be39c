"""Recipe knobs, declared once: what a spec writes (`smooth=0.5`), how it is parsed and rendered back,
its range, a one-line doc and what it does not combine with.

The spec parser, the text renderer, the generated parameter table of `docs/methods.md` and the
tuner read these declarations and nothing else. A knob of a key transform is a field of the
transform's dataclass (`knob(...)` as its default); the store recipe's own knobs (`r`, `keys`,
`sink`, `v`, `vgroup`, `fit`) are declared in `kvstrata.methods`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

NONE: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class Knob:
    """One `key=value` a store recipe takes.

    parse: text -> value, raising ValueError with the reason (the caller names the knob);
    render: value -> text that `parse` reads back equal; values: the range, as the docs show it;
    position: where the renderer and the docs table put it; needs: the knob that must be set
    for this one to mean anything (`ofmt` needs `outliers`); excludes: condition -> why not
    (conditions are named in `kvstrata.methods.CONDITIONS`).
    """

    key: str
    doc: str
    values: str
    parse: Callable[[str], object]
    render: Callable[[object], str] = str
    position: int = 100
    needs: str | None = None
    excludes: Mapping[str, str] = field(default_factory=lambda: NONE)


def knob(default, doc: str, values: str, parse: Callable[[str], object], *, render: Callable = str,
         position: int = 100, needs: str | None = None, excludes: Mapping[str, str] = NONE):
    """A dataclass field that is a recipe knob named after the field (see `Knob`)."""
    return field(default=default, metadata={"knob": dict(
        doc=doc, values=values, parse=parse, render=render, position=position, needs=needs,
        excludes=MappingProxyType(dict(excludes)),
    )})


def field_knobs(cls) -> list[tuple[dataclasses.Field, Knob]]:
    """The knobs a dataclass declares with `knob(...)`, in field order."""
    return [(f, Knob(f.name, **f.metadata["knob"])) for f in dataclasses.fields(cls) if "knob" in f.metadata]


# --- parsers: text -> value, ValueError with the reason -------------------------------------------
def integer(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or not lo <= int(text) <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}], got {text!r}")
        return int(text)

    return parse


def number(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not lo <= value <= hi:  # NaN fails too
            raise ValueError(f"must be a number in [{lo:g}, {hi:g}], got {text!r}")
        return value

    return parse


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {text!r}")
        return text

    return parse


def flag(text: str) -> bool:
    """`0` or `1`."""
    if text not in ("0", "1"):
        raise ValueError(f"must be 0 or 1, got {text!r}")
    return text == "1"


def render_flag(value: bool) -> str:
    return "1" if value else "0"


def parse_ranges(text: str, where: str, what: str, top: int) -> tuple[int, ...]:
    """`"0-3,7"` -> (0, 1, 2, 3, 7), in order, each once; raises ValueError naming `where` and the
    bad item (`what`: "a layer index"; `top`: the largest index allowed)."""
    out: list[int] = []
    for item in (p.strip() for p in text.split(",")):
        lo, dash, hi = item.partition("-")
        if not lo.strip().isdigit() or (dash and not hi.strip().isdigit()):
            raise ValueError(f"{where}: {item!r} is not {what} or an i-j range")
        a, b = int(lo), int(hi) if dash else int(lo)
        if a > b or b > top:
            raise ValueError(f"{where}: range {item!r} is empty or beyond {top}")
        out += range(a, b + 1)
    return tuple(dict.fromkeys(out))


def ranges_text(layers) -> str:
    """Inverse of `parse_ranges`: sorted indices -> `"0-3,7"`."""
    out, start = [], None
    layers = sorted(layers)
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)
