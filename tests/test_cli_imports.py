"""The CLI's import budget: `kvstrata --help`, every subcommand's `--help` and the refusals that need no
model (bad flags, a mistyped model name) answer without importing torch or transformers, in well under
a second of CPU. Heavy imports happen only inside the command that needs them."""

import json
import resource
import subprocess
import sys

HEAVY = ("torch", "transformers", "numpy", "safetensors", "matplotlib")
BUDGET_CPU_S = 1.0

PROBE = """
import json, sys
from kvstrata.cli import build_parser, main
names = list(build_parser()._subparsers._group_actions[0].choices)
calls = [["--help"]] + [[n, "--help"] for n in names] + json.loads(sys.argv[1])
seen = {}
for argv in calls:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
    seen[" ".join(argv)] = {"code": code, "heavy": heavy}
print("\\nRESULT " + json.dumps(seen))
"""

ENTRY = "import sys; from kvstrata.cli import main; sys.exit(main())"  # what the `kvstrata` script runs
REFUSALS = [
    ["generate", "--model", "smollm2-135x", "--prompt", "hi"],
    ["chat", "--model", "gemma3-27m", "--script", "docs/examples/agent_turns.txt"],
    ["serve", "--model", "nosuch-model"],
    ["serve", "--model", "smollm2-135m", "--port", "0"],
    ["bench", "--quick", "--model", "smollm2-135x", "--out", "/tmp/never"],
    ["accounting", "--model", "nosuch"],
    ["passkey", "--model", "nosuch"],
    ["generate", "--modle", "smollm2-135m"],
]


def cpu_of(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", ENTRY, *argv], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done


def test_help_and_refusals_import_no_torch():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(REFUSALS), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout.rpartition("RESULT ")[2])
    assert len(result) >= 28 + len(REFUSALS)  # --help, every subcommand's, the refusals
    loaded = {argv: r["heavy"] for argv, r in result.items() if r["heavy"]}
    assert loaded == {}, f"heavy modules imported by: {loaded}"
    codes = {argv: r["code"] for argv, r in result.items()}
    assert all(c == 0 for a, c in codes.items() if a.endswith("--help")), codes
    assert all(codes[" ".join(a)] == 2 for a in REFUSALS), codes


def test_help_and_a_mistyped_model_cost_under_a_second_of_cpu():
    for argv in (["--help"], ["chat", "--help"], ["generate", "--model", "smollm2-135x", "--prompt", "hi"]):
        cpu, done = cpu_of(argv)
        assert done.returncode in (0, 2) and "Traceback" not in done.stderr
        assert cpu < BUDGET_CPU_S, f"kvstrata {' '.join(argv)}: {cpu:.2f} s of CPU"
    _, done = cpu_of(["generate", "--model", "smollm2-135x", "--prompt", "hi"])
    assert done.stderr.startswith("kvstrata: error: --model: 'smollm2-135x' is neither a known model")


def test_the_budget_test_sees_a_heavy_import():
    """The probe itself: a command that does load torch is caught (so an empty list means something)."""
    probe = PROBE.replace("calls = [", "import torch  # noqa\ncalls = [")
    done = subprocess.run([sys.executable, "-c", probe, "[]", json.dumps(HEAVY)], capture_output=True,
                          text=True, timeout=300)
    result = json.loads(done.stdout.rpartition("RESULT ")[2])
    assert "torch" in result["--help"]["heavy"]


def test_every_flag_has_help_that_shows_its_default():
    """`kvstrata X --help` explains each flag and shows what it is when not given (`--model`, `--method`,
    `--tenant`, `--host`, `--port` ... everywhere)."""
    import argparse

    from kvstrata.cli import build_parser

    silent, hidden = [], []
    parsers = build_parser()._subparsers._group_actions[0].choices
    assert {"chat", "serve", "bench"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {(action.option_strings or [action.dest])[0]}"
            if not (action.help or "").strip():
                silent.append(flag)
            default = action.default
            if action.option_strings and default not in (None, False, argparse.SUPPRESS):
                shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
                if "".join(shown.split()) not in "".join(text.split()):  # help wraps at spaces and hyphens
                    hidden.append(f"{flag} (default {shown})")
    assert silent == [], f"flags without help: {silent}"
    assert hidden == [], f"defaults --help does not show: {hidden}"
