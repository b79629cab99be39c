"""`kvstrata methods --markdown`: docs/methods.md, generated from the method registry so the page
cannot drift from the code (a test compares the committed page with this output)."""

from __future__ import annotations

import dataclasses

import torch

from kvstrata.hf.segments import encode_segment
from kvstrata.methods import METHODS, parse_method

# SmolLM2-135M: 30 layers, 3 KV heads x 64 dims, every layer full attention
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64

HEADER = """# Methods

Generated from the method registry by `kvstrata methods --markdown > docs/methods.md`; a test fails
when this page differs from what the command prints.

## The spec grammar

```text
spec      := recipe (";" class "=" recipe)*      class in {full, sliding}, each at most once
recipe    := component ("+" component)*          at most one of each stratum
component := name [":" key=value ("," key=value)*]
```

The first recipe applies to every layer; `full=` / `sliding=` override one class of layers
(`nvfp4;sliding=fp8` keeps global KV in NVFP4 and sliding-window KV in FP8, as V4.1 does). A recipe
takes at most one component per stratum: a store codec, a keep policy, a depth-sharing method and a
read method compose with `+` (`streaming:keep=0.5+nvfp4`, `depth:g=4+nvfp4`,
`nvfp4+topk:k=256,indexer=lowrank`). Store codecs also take `r` (the newest `r` tokens stay in full
precision, KIVI's residual), `keys` (`token`: scales per token; `channel`: KIVI's keys grouped
per channel along tokens, integer codecs only) and `rot` (`hadamard`: K and V are rotated along
head_dim by a randomized Hadamard matrix before encoding, `rotseed` picks its signs, default 0;
the query is rotated the same way and the attention output rotated back, so nothing per token is
stored and bytes per token do not change).
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
    z = torch.zeros(1, KV_HEADS, 256, HEAD_DIM)
    seg = encode_segment(recipe, z, z)
    held = sum(t.numel() * t.element_size() for t in seg.parts())
    return held / 256 * LAYERS


def markdown() -> str:
    bf16 = bytes_per_token("bf16")
    out = [HEADER]
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
