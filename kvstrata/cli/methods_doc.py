"""`kvstrata methods --markdown`: docs/methods.md, generated from the method registry so the page
cannot drift from the code (a test compares the committed page with this output)."""

from __future__ import annotations

import dataclasses

from kvstrata.hf.segments import probe_segment
from kvstrata.methods import METHODS, parse_method

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
`nvfp4+topk:k=256,indexer=lowrank`). Store codecs also take `r` (the newest `r` tokens stay in full
precision, KIVI's residual), `keys` (`token`: scales per token; `channel`: KIVI's keys grouped
per channel along tokens, integer codecs only; the prefill is encoded whole, its last group ragged
and held as a whole group, later tokens wait in full precision for a whole group) and `rot`
(`hadamard`: K and V are rotated along head_dim by a randomized Hadamard matrix before encoding,
`rotseed` picks its signs, default 0; the query is rotated the same way and the attention output
rotated back, so nothing per token is stored and bytes per token do not change), `smooth` (`A` in
[0, 1], default 0: each layer's keys
are divided per channel by their prefill magnitude to the power `A` (normalised per head) and the
query multiplied by the same, so q.k is unchanged while outlier channels stop setting every
token's scale; the divisors, `head_dim` fp32 per KV head and layer, are counted in the bytes),
`center` (`0` or `1`, default 0: keys less their per-channel prefill mean are encoded and the mean
added back on decode; the fused kernel shifts every score by `q.mean`, which the softmax ignores
unless a softcap bends the scores, where it is added back; `head_dim` fp32 per KV head and layer),
`sink` (`N`, default 0: the first `N` tokens of full-attention layers stay in bf16 beside the
codes, counted; attention sinks take much of every query's weight, so their error weighs most;
sliding layers hold none, their window drops them),
`outliers` (`c`, default 0: per layer and KV head the `c` key channels of largest prefill magnitude
are held beside the codes, which hold the keys with those channels zeroed; attention adds their
`q.k` as a score bias, in the fused kernel too; `2c` bytes per token and KV head in bf16, counted;
per-token keys only, so integer codecs need `keys=token`), `ofmt` (`bf16` or `fp8`, default bf16,
with `outliers` only: the kept channels in FP8 E4M3, saturating at ±448, `c` bytes per token and KV
head), `v` (a store codec's name: the
values are encoded with it, default parameters, while the keys keep the recipe's codec;
`int2:r=32,v=nvfp4` holds KIVI INT2 keys and NVFP4 values; what `kvstrata tune --kv-apart` emits),
`vgroup` (`N`, with `v=int4` / `v=int3` / `v=int2` only: the values' group, per token along `head_dim`;
`v=int4,vgroup=64` is 4.5 bits on a 64-dim head, NVFP4's; `v=int3,vgroup=64` 3.5 bits) and `fit`
(`minmax` or `lsq`, default
minmax: `lsq` picks scales for least squared error, kept per group only where they beat the range's;
INT4 / INT3 / INT2 refit each group's scale and minimum by a few rounds of rounding and a least-squares
line, NVFP4 maps each block's largest magnitude to 6, 5 or 4, whichever errs least; same format and
bytes, slower encoding; it reaches every codec of the recipe that has a fit, keys' and values').
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
