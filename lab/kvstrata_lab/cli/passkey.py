"""`kvstrata passkey`: a long-context passkey prompt answered through compressed caches."""

from __future__ import annotations

from kvstrata.cli.inputs import BIG, SEED, float_in, int_in, nonempty


def register(sub) -> None:
    pk = sub.add_parser("passkey", help="answer a long-context passkey prompt through compressed caches")
    pk.add_argument("--model", required=True)
    pk.add_argument("--methods", default="bf16|nvfp4|mxfp4", type=nonempty, help="'|'-separated method specs")
    pk.add_argument("--tokens", type=int_in(128, BIG), default=4000,
                    help="context length, within the model's")
    pk.add_argument("--depth", type=float_in(0, 1), default=0.5, help="relative position of the needle, 0..1")
    pk.add_argument("--seed", type=SEED, default=0)
    pk.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import model_name

    model_name(args.model)  # a mistyped model is named at once (before torch loads)

    from kvstrata.cli.inputs import check_context, check_fits
    from kvstrata.hf.run import generate
    from kvstrata.methods import parse_method
    from kvstrata.models import check_method, load_config, load_model, load_tokenizer
    from kvstrata_lab.bench.passkey import passkey_prompt

    methods = args.methods.split("|")
    for m in methods:
        parse_method(m)  # a bad spec is named before the tokenizer, the config or the weights
    specs = [check_method(args.model, m) for m in methods]
    check_context(args.model, args.tokens, "--tokens")
    tok = load_tokenizer(args.model)  # the prompt is checked before the weights load
    p = passkey_prompt(tok, args.tokens, args.depth, seed=args.seed)
    ids = tok(p.context + p.question, return_tensors="pt").input_ids
    check_fits(load_config(args.model), ids.shape[1], 8, "the passkey prompt", "the answer")
    model = load_model(args.model)
    print(f"{args.model}: {ids.shape[1]} tokens, needle {p.answer} at depth {args.depth}")
    for spec in specs:
        g = generate(model, tok, ids, spec, max_new_tokens=8)
        ok = p.answer in g.text
        ratio = g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token
        print(
            f"  {str(spec):<22} {'PASS' if ok else 'FAIL'}  answer={g.text.strip()[:24]!r:<28} KV "
            f"{g.kv_bytes_per_token:>9,.1f} B/token ({ratio:.2f}x smaller than bf16)",
            flush=True,
        )
    return 0
