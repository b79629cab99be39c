"""Checks of CLI input made before any work starts: bounded numbers (argparse types), prompt files,
and prompts that must fit the model's context together with the tokens to generate.

Every failure is a ValueError (or argparse's error) naming the flag and the problem; `kvstrata.cli.main`
prints it as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path

PROMPT_MAX_BYTES = 16 << 20
SCRIPT_MAX_BYTES = 4 << 20
BIG = 10**9


def _bounded(kind: type, lo, hi, what: str, fmt: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:{fmt}}, {hi:{fmt}}], got {text}")
        return value

    return parse


def int_in(lo: int, hi: int):
    """argparse type: a whole number in [lo, hi]."""
    return _bounded(int, lo, hi, "a whole number", ",")


def float_in(lo: float, hi: float):
    """argparse type: a finite number in [lo, hi]."""
    return _bounded(float, lo, hi, "a number", "g")


SEED = int_in(0, 2**32 - 1)


def field_default(cls, name: str):
    """The default of a config dataclass's field (a subcommand's flag defaults to it, never to a copy)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def nonempty(text: str) -> str:
    """argparse type: text with something besides whitespace in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def model_name(text: str, flag: str = "--model") -> str:
    """Refuse a model that is neither a known one nor a local model directory, from the catalog alone
    (no torch, no transformers: a mistyped name answers at once). The message is the loader's
    (`kvstrata.models.loader.check`), which checks the same when the model loads."""
    from kvstrata.models.catalog import unknown_model

    why = unknown_model(text)
    if why:
        raise ValueError(f"{flag}: {why}")
    return text


def prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """`--prompt` or the UTF-8 text of `--prompt-file`; refused when empty."""
    from kvstrata.user_files import read_text_file

    flag = "--prompt-file" if prompt_file else "--prompt"
    text = read_text_file(prompt_file, flag, PROMPT_MAX_BYTES) if prompt_file else prompt
    if not text or not text.strip():
        raise ValueError(f"{flag}: the prompt is empty")
    return text


def context_tokens(config) -> int:
    """The longest sequence a model of this config takes (its position embeddings)."""
    text = config.get_text_config()
    return int(getattr(text, "max_position_embeddings", 0) or 0) or BIG


def check_fits(config, prompt_tokens: int, new_tokens: int, what: str = "the prompt",
               new_what: str = "--max-new-tokens") -> None:
    """Refuse a prompt without tokens, or one that with the tokens to generate exceeds the context of a
    model of this config (the config alone: checked with the tokenizer, before the weights load)."""
    if prompt_tokens < 1:
        raise ValueError(f"{what} has no tokens")
    limit = context_tokens(config)
    if prompt_tokens + new_tokens > limit:
        raise ValueError(f"{what} is {prompt_tokens:,} token{'s' * (prompt_tokens != 1)}; with "
                         f"{new_tokens:,} new tokens ({new_what}) that exceeds the model's context of "
                         f"{limit:,} tokens")


def csv_items(text: str) -> tuple[str, ...]:
    """`a, b,,c` -> ('a', 'b', 'c')."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def length_arg(text: str, where: str) -> int:
    """A context length in tokens, or a clear error naming where it came from."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{where}: context length {text!r} is not a positive whole number of tokens")
    return n


def split_methods(text: str) -> list[str]:
    """Methods are comma-separated, but a spec has commas too: split only before a method name (or a
    spec that starts with a per-layer or per-class override, `layers[...]=` / `full=` / `sliding=`)."""
    import re

    from kvstrata.methods import METHODS

    out: list[str] = []
    for piece in text.split(","):
        name = piece.split(":")[0].split("+")[0].split(";")[0].strip().lower()
        stock = name in ("dynamic", "static")
        starts = name in METHODS or stock or re.match(r"\s*(layers\[|(full|sliding)\s*=)", piece)
        if out and not starts:
            out[-1] += "," + piece
        else:
            out.append(piece.strip())
    return out


def check_context(model: str, tokens: int, flag: str) -> None:
    """Refuse a length past the model's context, from its config alone (no weights loaded)."""
    from kvstrata.models import load_config

    limit = getattr(load_config(model).get_text_config(), "max_position_embeddings", None)
    if limit and tokens > limit:
        raise ValueError(f"{flag}: {tokens:,} tokens exceed {model}'s context of {limit:,} tokens")


def writable_dir(path: str | Path, flag: str) -> Path:
    """Refuse an output directory that cannot be created or written, before any work starts: the nearest
    existing ancestor must be a directory this process may write (checked, nothing created)."""
    out = Path(path).expanduser()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag}: cannot write to {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write to {out}: {probe} is not writable")
    return out
