"""`kvstrata` command line: generate, methods, models (and more as strata land)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_methods(args) -> int:
    from kvstrata.methods import METHODS

    for entry in METHODS.values():
        defaults = ",".join(f"{k}={v}" for k, v in entry.defaults.items())
        print(f"{entry.name:<8} {entry.stratum:<6} {entry.summary}  [{defaults}]")
    return 0


def _cmd_models(args) -> int:
    from kvstrata.models import KNOWN_MODELS
    from kvstrata.models.loader import COMPLETE_MARK, converted_path

    for m in KNOWN_MODELS.values():
        state = "installed" if m.installed() else f"missing ({m.install_command})"
        if (converted_path(m.name) / COMPLETE_MARK).exists():
            state += ", converted"
        print(f"{m.name:<14} {state}\n  {m.description}")
    return 0


def _cmd_generate(args) -> int:
    from kvstrata.hf.run import generate
    from kvstrata.methods import parse_method
    from kvstrata.models import load

    spec = parse_method(args.method)  # fail fast, before the model loads
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    model, tok = load(args.model)
    ids = tok(prompt, return_tensors="pt").input_ids
    g = generate(model, tok, ids, spec, args.max_new_tokens)
    if args.json:
        row = {
            "text": g.text, "method": str(spec), "model": args.model, "context_tokens": g.context_tokens,
            "new_tokens": len(g.new_tokens), "kv_bytes": g.kv_bytes, "kv_bytes_per_token": g.kv_bytes_per_token,
            "kv_bytes_per_token_bf16": g.kv_bytes_per_token_bf16,
            "compression_vs_bf16": g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token if g.kv_bytes_per_token else None,
        }
        print(json.dumps(row))
    else:
        print(g.text)
        ratio = g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token if g.kv_bytes_per_token else float("nan")
        print(
            f"\n[{spec}] context {g.context_tokens} tokens; KV {g.kv_bytes_per_token:,.1f} B/token "
            f"vs bf16 {g.kv_bytes_per_token_bf16:,.1f} B/token ({ratio:.2f}x smaller)",
            file=sys.stderr,
        )
    return 0


def _cmd_passkey(args) -> int:
    from kvstrata.bench.passkey import passkey_prompt
    from kvstrata.hf.run import generate
    from kvstrata.methods import parse_method
    from kvstrata.models import load

    specs = [parse_method(m) for m in args.methods.split("|")]
    model, tok = load(args.model)
    p = passkey_prompt(tok, args.tokens, args.depth, seed=args.seed)
    ids = tok(p.context + p.question, return_tensors="pt").input_ids
    print(f"{args.model}: {ids.shape[1]} tokens, needle {p.answer} at depth {args.depth}")
    for spec in specs:
        g = generate(model, tok, ids, spec, max_new_tokens=8)
        ok = p.answer in g.text
        ratio = g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token
        print(f"  {str(spec):<22} {'PASS' if ok else 'FAIL'}  answer={g.text.strip()[:24]!r:<28} "
              f"KV {g.kv_bytes_per_token:>9,.1f} B/token ({ratio:.2f}x smaller than bf16)", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstrata", description="KV-cache compression, measured on real models.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with a compressed KV cache")
    g.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, or a local model directory")
    g.add_argument("--method", default="bf16", help="method spec, e.g. nvfp4:r=64 or nvfp4;sliding=fp8")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_cmd_generate)

    pk = sub.add_parser("passkey", help="answer a long-context passkey prompt through compressed caches")
    pk.add_argument("--model", required=True)
    pk.add_argument("--methods", default="bf16|nvfp4|mxfp4", help="'|'-separated method specs")
    pk.add_argument("--tokens", type=int, default=4000)
    pk.add_argument("--depth", type=float, default=0.5)
    pk.add_argument("--seed", type=int, default=0)
    pk.set_defaults(func=_cmd_passkey)

    sub.add_parser("methods", help="list registered methods").set_defaults(func=_cmd_methods)
    sub.add_parser("models", help="list known models and whether they are installed").set_defaults(func=_cmd_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvstrata: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
