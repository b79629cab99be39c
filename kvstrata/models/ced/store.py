"""An encoder-decoder model directory: the original model's files, its config naming the split and
window (`kvstrata_ced`), the projections (`ced.safetensors`) and what the fit saw (`ced.json`).
`save` writes one atomically; `kvstrata.models.load` takes it back as a `CEDModel`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvstrata.codecs.qtensor import held_bytes
from kvstrata.hf.cache import layer_classes
from kvstrata.hf.projected import CONFIG_KEY, STORED, ced_config, ced_plan, ced_stored, hidden_recipe
from kvstrata.hf.segments import probe_segment
from kvstrata.methods import parse_method
from kvstrata.models.ced.model import CEDModel, Projections, decoder_shape, encoder_decoder

WEIGHTS = "ced.safetensors"
REPORT = "ced.json"


def check_plan(config, split: int | None, n_win: int) -> int:
    """The split (None: half the depth), refused where it leaves the encoder or the decoder empty, or
    the window is under one token."""
    layers = config.get_text_config(decoder=True).num_hidden_layers
    split = layers // 2 if split is None else split
    if not 1 <= split <= layers - 1:
        raise ValueError(
            f"split must be a layer in [1, {layers - 1}] (the model has {layers} layers), got {split}"
        )
    if n_win < 1:
        raise ValueError(f"n_win must be >= 1 token, got {n_win}")
    return split


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write(
    tmp: Path,
    source: Path,
    model,
    proj: Projections,
    split: int,
    n_win: int,
    report: dict,
    store: str = STORED[0],
) -> str:
    """Fill `tmp` with the encoder-decoder form of the model in `source` (its files linked or copied,
    its config naming the split, window and what the store keeps); returns the completion mark's text."""
    check_plan(model.config, split, n_win)
    for f in source.iterdir():
        if (
            f.is_file()
            and f.name not in ("config.json", WEIGHTS, REPORT)
            and not f.name.startswith("kvstrata-")
        ):
            _link_or_copy(f, tmp / f.name)
    config = model.config.__class__.from_dict(model.config.to_dict())
    setattr(config.get_text_config(decoder=True), CONFIG_KEY, ced_config(split, n_win, store))
    config.save_pretrained(tmp)
    save_file(
        {k: v.float().contiguous() for k, v in proj.state_dict().items()},
        str(tmp / WEIGHTS),
        metadata={"split": str(split), "n_win": str(n_win)},
    )
    (tmp / REPORT).write_text(
        json.dumps({"split": split, "n_win": n_win, "store": store, **report}, indent=1)
    )
    return f"ced split {split} n_win {n_win} store {store}"


def wrap(base, path: Path) -> CEDModel:
    """The encoder-decoder model of a loaded `base` whose directory `path` holds the projections."""
    split, n_win = ced_plan(base.config.get_text_config(decoder=True))
    check_plan(base.config, split, n_win)
    stored = ced_stored(base.config.get_text_config(decoder=True))
    hidden, kv_heads, dim, layers = decoder_shape(base.config)
    proj = Projections(hidden, kv_heads, dim, layers - split)
    try:
        state = load_file(str(path / WEIGHTS))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ValueError(
            f"{path}: the encoder-decoder's projections ({WEIGHTS}) cannot be read: {exc}"
        ) from None
    want = {k: tuple(v.shape) for k, v in proj.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if want != got:
        raise ValueError(
            f"{path}: {WEIGHTS} does not fit the config (split {split}: {len(want) // 2} decoder "
            f"layers of {2 * kv_heads * dim} outputs expected)"
        )
    proj.load_state_dict(state)
    return encoder_decoder(base, proj, split, n_win, stored)


def fit_summary(report) -> dict:
    """A fit report as `ced.json` records it."""
    return dataclasses.asdict(report)


def decoder_bytes_per_token(config, split: int, method: str = "bf16") -> dict:
    """What the persistent store would keep per token for the decoder half, both ways, at `method`'s
    full-attention codec: the projected K and V of every full-attention decoder layer (sliding
    layers' K/V are not kept long), or `H(split)` once as the store keeps it ("hidden": the value
    codec, per token, the row's halves as one head's K and V) with the projections applied on load."""
    hidden, kv_heads, dim, _ = decoder_shape(config)
    full = sum(cls == "full" for cls, _ in layer_classes(config)[split:])
    recipe = replace(parse_method(method).full, transforms=())
    tokens = 256
    seg = probe_segment(recipe, kv_heads, dim, tokens)
    projected = full * (held_bytes(seg.keys.parts.values()) + held_bytes(seg.values.parts.values()))
    row = probe_segment(hidden_recipe(recipe), 1, hidden // 2, tokens)
    h = held_bytes(row.keys.parts.values()) + held_bytes(row.values.parts.values())
    return {"method": method, "projected": projected / tokens, "hidden": h / tokens, "ratio": h / projected}
