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


#: help for flags many subcommands share, where a subcommand's own parser gives none
SHARED_HELP = {
    "--model": "a known model (`kvstrata models`: smollm2-135m, gemma3-270m, ...), tiny-llama / tiny-gemma3 "
               "(random weights), or a local model directory",
    "--method": "method spec (`kvstrata methods`, docs/methods.md), e.g. nvfp4, int4:r=32 or "
                "nvfp4;sliding=fp8",
    "--seed": "seed of the generated instances (the same seed gives the same prompts)",
    "--out": "directory the results are written to (created if missing)",
    "--haystack": "the filler the needles hide in: noise (random words) or natural (prose)",
}


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is none to
    say (None, False, or a positional argument)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line `kvstrata: error: ...` and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"kvstrata: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvstrata", description="KV-cache compression, measured on real models.",
               formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for module in PRODUCT:
        module.register(sub)
    for ep in entry_points(group=PLUGINS):
        ep.load()(sub)
    for parser in sub.choices.values():
        parser.formatter_class = HelpFormatter
        for action in parser._actions:
            if not action.help and action.option_strings:
                action.help = SHARED_HELP.get(action.option_strings[0])
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
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (a command that keeps work says what)
        print(f"\nkvstrata {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
