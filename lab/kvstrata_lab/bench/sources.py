"""Haystack sources beyond RULER's noise and the language reference: Python source code,
module docstrings, a Unicode table and key-value dumps, all read from the standard library of the
Python that runs the benchmark (nothing downloaded, the same text on every machine with the same
Python version).

Each source is a list of pieces (a block of code, a paragraph, a line of a table) in an order
shuffled by the seed; `corpus.units` serves them to the haystack builder like the other kinds. The
sources are disjoint: the code of modules `a`–`m` and of `n`–`z` are two sources (a block of the
second that the first also has is dropped), and a docstring
paragraph (of modules `n`–`z`) that also occurs in the language reference or in the code of
`a`–`m` is dropped (`families` relies on it: no
calibration text is report text).
"""

from __future__ import annotations

import ast
import html.entities
import random
import sysconfig
import unicodedata
from functools import lru_cache
from pathlib import Path

#: what `pieces` serves; `natural` (`natural_paragraphs`) and `noise` are corpus kinds
KINDS = ("code-am", "code-nz", "docstrings", "unicode-table", "kv-dump")
CHARS = 400_000  # text read per source (a 32k-token haystack needs about 130k characters)


def _stdlib_files(first: str, last: str) -> list[Path]:
    """Top-level standard-library modules whose name starts in [first, last], sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py")
                  if first <= p.name[0].lower() <= last and not p.name.startswith("_"))


def _code_blocks(files: list[Path]) -> list[str]:
    """Blank-line separated blocks of the files' source, each ending in a blank line."""
    out, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for block in text.split("\n\n"):
            block = block.strip("\n")
            if block.strip() and block.isascii():
                out.append(block + "\n\n")
                size += len(block)
        if size > CHARS:
            break
    return out


def _docstring_paragraphs(files: list[Path]) -> list[str]:
    """Paragraphs (> 120 characters, ASCII) of the modules', classes' and functions' docstrings."""
    out, size = [], 0
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                for para in doc.split("\n\n"):
                    para = " ".join(para.split())
                    if len(para) > 120 and para.isascii() and para[0].isalpha():
                        out.append(para + "\n")
                        size += len(para)
        if size > CHARS:
            break
    return out


def _unicode_rows() -> list[str]:
    """`U+00C0 | LATIN CAPITAL LETTER A WITH GRAVE | Lu | 0` rows of named code points."""
    rows = []
    for cp in range(0x20, 0x3000):
        name = unicodedata.name(chr(cp), "")
        if name:
            ch = chr(cp)
            rows.append(f"U+{cp:04X} | {name} | {unicodedata.category(ch)} | {unicodedata.combining(ch)}\n")
    return rows


def _kv_lines() -> list[str]:
    """`key = value` lines: HTML entity names with their code points, then the codec aliases."""
    import encodings.aliases  # stdlib table, read only when this source is asked for

    lines = [f"entity.{name.rstrip(';')} = U+{ord(text[0]):04X}\n" for name, text in
             sorted(html.entities.html5.items()) if name.endswith(";")]
    lines += [f"codec.alias.{k} = {v}\n" for k, v in sorted(encodings.aliases.aliases.items())]
    return lines


def natural_paragraphs(seed: int = 0) -> list[str]:
    """Paragraphs of real English prose from the standard library's `pydoc_data.topics`, shuffled by
    `seed`."""
    from pydoc_data.topics import (
        topics,  # about a megabyte of text, loaded only when natural prose is asked for
    )

    paras = []
    for key in sorted(topics):
        for p in topics[key].split("\n\n"):
            p = " ".join(p.split())
            if len(p) > 200 and p[0].isalpha() and not p.startswith(("Changed in", "New in", "Added in")):
                paras.append(p)
    random.Random(seed).shuffle(paras)
    return paras


@lru_cache(maxsize=None)
def _pieces(kind: str) -> tuple[str, ...]:
    if kind == "code-am":
        return tuple(_code_blocks(_stdlib_files("a", "m")))
    if kind == "code-nz":  # without the blocks `a`-`m` also has (`return result`, a shared idiom)
        calibration = set(_pieces("code-am"))
        return tuple(b for b in _code_blocks(_stdlib_files("n", "z")) if b not in calibration)
    if kind == "docstrings":
        reference = {p.strip() for p in natural_paragraphs(0)}
        code = " ".join(" ".join(_pieces("code-am")).split())  # a docstring copied into a calibration file
        return tuple(p for p in _docstring_paragraphs(_stdlib_files("n", "z"))
                     if p.strip() not in reference and p.strip() not in code)
    if kind == "unicode-table":
        return tuple(_unicode_rows())
    if kind == "kv-dump":
        return tuple(_kv_lines())
    raise ValueError(f"unknown haystack {kind!r}")


def pieces(kind: str, seed: int = 0) -> list[str]:
    """The source's pieces, rotated to a start chosen by `seed` (a table's rows and a file's blocks
    stay in order: what a reader of such text sees)."""
    got = list(_pieces(kind))
    if not got:
        raise ValueError(f"haystack {kind!r}: this Python's standard library gave no text")
    start = random.Random(f"{kind}/{seed}").randrange(len(got))
    return got[start:] + got[:start]
