"""`kvstrata methods`, `kvstrata models`, `kvstrata accounting`: what there is, and what it holds."""

from __future__ import annotations

import json

from kvstrata.cli.inputs import BIG, int_in


def register(sub) -> None:
    me = sub.add_parser("methods", help="list registered methods")
    me.add_argument("--markdown", action="store_true",
                    help="print docs/methods.md (generated from the registry)")
    me.set_defaults(func=methods)
    mo = sub.add_parser("models", help="list known models and whether they are installed")
    mo.set_defaults(func=models)
    a = sub.add_parser("accounting", help="bytes per token, per layer: a V4.1 preset or an HF model + method")
    a.add_argument("--preset", help="v41-flash, v4-flash or tiny-v41")
    a.add_argument("--model", help="a known model or a local model directory")
    a.add_argument("--method", default="bf16", help="method spec whose bytes are counted (with --model)")
    a.add_argument("--tokens", type=int_in(1, BIG), default=4096, help="context length for HF accounting")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=accounting)


def methods(args) -> int:
    from kvstrata.cli.methods_doc import defaults, markdown
    from kvstrata.registry import STRATA, entries

    if args.markdown:
        print(markdown(), end="")
        return 0
    for entry in (e for stratum in STRATA for e in entries(stratum)):
        params = ",".join(f"{k}={v}" for k, v in defaults(entry.name).items())
        print(f"{entry.name:<10} {entry.stratum:<6} {entry.summary}  [{params}]")
    return 0


def models(args) -> int:
    from kvstrata.models import KNOWN_MODELS, TINY_MODELS
    from kvstrata.models.loader import is_converted

    for m in KNOWN_MODELS.values():
        state = "installed" if m.installed() else f"missing ({m.install_command})"
        if is_converted(m.name):
            state += ", converted"
        print(f"{m.name:<14} {state}\n  {m.description}")
    for t in TINY_MODELS.values():
        print(f"{t.name:<14} built in: random weights for smoke tests, written on first use\n  "
              f"{t.description}")
    return 0


def accounting(args) -> int:
    from kvstrata.cli.inputs import model_name

    if bool(args.preset) == bool(args.model):
        raise ValueError("give exactly one of --preset (v41-flash, v4-flash, tiny-v41, small-v41) or --model")
    if args.model:
        model_name(args.model)  # a mistyped model is named at once (before torch loads)

    from kvstrata import accounting as acc
    if args.preset:
        from dataclasses import asdict

        from kvstrata.models.v41_layout import cache_plan, compare, presets

        known = presets()
        if args.preset not in known:
            raise ValueError(f"unknown preset {args.preset!r} (known: {', '.join(known)})")
        baseline = "v4-flash" if args.preset != "v4-flash" else "v41-flash"
        report = compare(args.preset, baseline)
        plan = cache_plan(known[args.preset])
        if args.json:
            print(json.dumps({**report, "layers": [asdict(p) for p in plan]}, indent=1))
        else:
            print(acc.format_v41(report, plan))
        return 0
    from transformers import AutoConfig

    from kvstrata.methods import parse_method
    from kvstrata.models import resolve

    parse_method(args.method)
    config = AutoConfig.from_pretrained(resolve(args.model), local_files_only=True)
    report = acc.account_hf(config, args.method, args.tokens)
    print(json.dumps(report, indent=1) if args.json else acc.format_hf(report, args.model))
    return 0
