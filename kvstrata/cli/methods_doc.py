"""`kvstrata methods --markdown`: docs/methods.md, generated from the method registry so the page
cannot drift from the code (a test compares the committed page with this output)."""

from __future__ import annotations

import dataclasses

from kvstrata.hf.segments import probe_segment
from kvstrata.methods import CONDITIONS, METHODS, RECIPE_KNOBS, knob_table, parse_method

# SmolLM2-135M: 30 layers, 3 KV heads x 64 dims, every layer full attention
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64

HEADER = """# Methods

Generated from the method registry by `kvstrata methods --markdown > docs/methods.md`; a test fails
when this page differs from what the command prints.

## The spec grammar

```text
spec      := chunk (";" chunk)*
chunk     := recipe | class "=" recipe | "layers[" ranges "]=" recipe
                                                 class in {full, sliding}, each at most once
ranges    := (i | i "-" j) ("," (i | i "-" j))*  0-based decoder layers, each assigned at most once
recipe    := component ("+" component)*          at most one of each stratum
component := name [":" key=value ("," key=value)*]
```

A bare recipe (the first chunk, `bf16` when absent) applies to every layer; `full=` / `sliding=`
override one class of layers (`nvfp4;sliding=fp8` keeps global KV in NVFP4 and sliding-window KV
in FP8, as V4.1 does); `layers[...]=` overrides the listed layers and wins over both
(`nvfp4:rot=hadamard;layers[0-3]=fp8`; `kvstrata tune` emits such specs). A per-layer recipe takes
a store codec and a keep policy; depth sharing and top-k reads apply to the whole model. A recipe
takes at most one component per stratum: a store codec, a keep policy, a depth-sharing method and a
read method compose with `+` (`streaming:keep=0.5+nvfp4`, `depth:g=4+nvfp4`,
`nvfp4+topk:k=256,indexer=lowrank`). A store codec takes its own parameters (tables below) and
the recipe knobs of the next table; with depth sharing, `keys=channel` becomes `keys=token` (depth
blocks group tokens themselves). Every parsed spec renders back to text that parses equal
(`kvstrata.methods.render`).

## Recipe knobs

Each knob is declared once (`kvstrata.methods.RECIPE_KNOBS`, and the fields of each key transform
in `kvstrata.codecs`); the parser, the renderer, this table and `kvstrata tune` read the
declarations. Key transforms run in the order the table lists them on encode (centering,
smoothing, outlier channels, rotation) and are undone in reverse; their state travels with the
codes, so dense reads, top-k reads and the persistent store take every knob. The persistent
store takes every spec but keep policies and depth sharing (`kvstrata.methods.STORE_EXCLUDES`).
"""


def defaults(name: str) -> dict:
    """Every parameter of a registered method with its default (config fields, then r / keys)."""
    entry = METHODS[name]
    return {f.name: f.default for f in dataclasses.fields(entry.cls)} | dict(entry.defaults)


def _params(name: str) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in defaults(name).items()) or "–"


def bytes_per_token(spec: str) -> float:
    """SmolLM2-135M bytes per token with `spec`'s codec (no full-precision residual), measured by
    encoding 256 tokens of every KV head."""
    recipe = parse_method(spec).full
    seg = probe_segment(recipe, KV_HEADS, HEAD_DIM)
    held = sum(t.numel() * t.element_size() for t in seg.parts())
    return held / 256 * LAYERS


def _knob_default(key: str, owner: type | None) -> str:
    """A knob's default as the table shows it (a recipe knob's may depend on the codec)."""
    if owner is not None:
        f = next(f for f in dataclasses.fields(owner) if f.name == key)
        return f"`{f.metadata['knob']['render'](f.default)}`"
    rk = next(rk for rk in RECIPE_KNOBS if rk.knob.key == key)
    by: dict[str, list[str]] = {}
    for name, entry in METHODS.items():
        if entry.stratum == "store":
            value = rk.default(entry)
            by.setdefault("–" if value is None else f"`{rk.knob.render(value)}`", []).append(name)
    (common, _), *rest = sorted(by.items(), key=lambda kv: -len(kv[1]))
    return "; ".join([common] + [f"{', '.join(names)}: {value}" for value, names in rest])


def knob_rows() -> list[str]:
    """The recipe-knob table: one row per knob, from its declaration."""
    rows = ["| knob | values | default | what | does not combine with |", "|---|---|---|---|---|"]
    for k, owner in knob_table():
        what = k.doc + (f" (needs `{k.needs}`)" if k.needs else "")
        excludes = "; ".join(f"{CONDITIONS[c][0]}: {why}" for c, why in k.excludes.items()) or "–"
        rows.append(f"| `{k.key}` | {k.values} | {_knob_default(k.key, owner)} | {what} | {excludes} |")
    return rows


def markdown() -> str:
    bf16 = bytes_per_token("bf16")
    out = [HEADER, *knob_rows(), ""]
    sections = (("store", "Store: how a kept entry is encoded"), ("keep", "Keep: which tokens stay"),
                ("depth", "Depth sharing: KV shared across adjacent layers"), ("read", "Read: what a decode "
                                                                                       "step reads"))
    for stratum, title in sections:
        names = [n for n, e in METHODS.items() if e.stratum == stratum]
        out.append(f"## {title}\n")
        if stratum == "store":
            out.append("Bytes per token are SmolLM2-135M's (30 layers x 2 x 3 KV heads x 64 dims) for the "
                       "encoded tokens, measured by encoding them; `r` full-precision tokens come on top.\n")
            out += ["| name | what | parameters (defaults) | SmolLM2 B/token | x smaller than bf16 |",
                    "|---|---|---|---|---|"]
            for n in names:
                b = bytes_per_token(n)
                out.append(f"| `{n}` | {METHODS[n].summary} | {_params(n)} | {b:,.0f} | {bf16 / b:.2f} |")
        else:
            out += ["| name | what | parameters (defaults) |", "|---|---|---|"]
            out += [f"| `{n}` | {METHODS[n].summary} | {_params(n)} |" for n in names]
        out.append("")
    return "\n".join(out)
