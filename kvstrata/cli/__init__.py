"""`kvstrata` command line: the parser and entry point. Each subcommand is a module of its own with a
`register(sub)` that builds its parser (defaults from its config dataclass) and names the function
that runs it: the product commands here (`generate`, `info`, `store_admin`, `chat`, `serve`), and
the lab's -- the benchmark, the tuner, the evidence commands -- from every installed plugin in the
entry-point group `kvstrata.commands` (the `kvstrata-lab` package in `lab/`)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from kvstrata.cli import chat, generate, info, serve, store_admin

PRODUCT = (generate, info, store_admin, chat, serve)
PLUGINS = "kvstrata.commands"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line `kvstrata: error: ...` and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"kvstrata: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvstrata", description="KV-cache compression, measured on real models.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in PRODUCT:
        module.register(sub)
    for ep in entry_points(group=PLUGINS):
        ep.load()(sub)
    return p


def one_line(e: BaseException) -> str:
    """The first line of an error's message (allocation failures said as such)."""
    text = " ".join(next((ln for ln in str(e).splitlines() if ln.strip()), "").split()) or type(e).__name__
    oom = type(e).__name__ == "OutOfMemoryError"
    if isinstance(e, MemoryError) or "can't allocate memory" in text or oom:
        return f"out of memory ({text}): try a shorter input or fewer tokens"
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, MemoryError) as e:
        print(f"kvstrata: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
