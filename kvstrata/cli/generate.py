"""`kvstrata generate`: one prompt through a compressed cache, and what the cache held."""

from __future__ import annotations

import functools
import json
import sys

from kvstrata.cli.inputs import BIG, int_in, nonempty
from kvstrata.settings import DTYPES, GenerateConfig


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate with a compressed KV cache")
    g.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, or a local model directory")
    g.add_argument("--method", default="bf16", type=nonempty,
                   help="method spec, e.g. nvfp4:r=64 or nvfp4;sliding=fp8")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=nonempty, help="the prompt text")
    src.add_argument("--prompt-file", help="a UTF-8 text file (at most 16 MiB)")
    g.add_argument("--max-new-tokens", type=int_in(1, BIG), default=GenerateConfig.max_new_tokens,
                   help="with the prompt, within the model's context")
    g.add_argument("--prefill-chunk", type=int_in(0, BIG), default=GenerateConfig.prefill_chunk,
                   help="prompt tokens per prefill pass (bounds the prefill's transient memory; 0 = one "
                        "pass); the default is `kvstrata serve --prefill-chunk`'s")
    g.add_argument("--store-block", type=int_in(0, BIG), default=GenerateConfig.store_block,
                   help="also cut the prompt at its last multiple of N tokens, as `kvstrata serve` with "
                        "store block size N does (a lossy cache then holds what the server's does; 0 = "
                        "no store)")
    g.add_argument("--profile", type=int_in(1, 200), metavar="N",
                   help="print to stderr the N functions with the most self time, then kvstrata's N with the "
                        "most total time (cProfile)")
    g.add_argument("--dtype", choices=DTYPES, default=DTYPES[0],
                   help="the model's weights and activations (bf16: fast on CPUs with AVX512-BF16)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import model_name

    model_name(args.model)  # a mistyped model is named at once (before torch loads)

    from kvstrata.cli.inputs import check_fits, prompt_text
    from kvstrata.hf.run import generate, peak_rss_mb
    from kvstrata.methods import parse_method
    from kvstrata.models import check_method, load_config, load_model, load_tokenizer

    parse_method(args.method)  # then a bad spec, before the tokenizer, the config or the weights
    prompt = prompt_text(args.prompt, args.prompt_file)
    spec = check_method(args.model, args.method)  # everything checked before the weights load
    tok = load_tokenizer(args.model)
    ids = tok(prompt, return_tensors="pt").input_ids
    check_fits(load_config(args.model), ids.shape[1], args.max_new_tokens)
    model = load_model(args.model, args.dtype)
    go = functools.partial(generate, model, tok, ids, spec, args.max_new_tokens,
                           prefill_chunk=args.prefill_chunk or None, store_block=args.store_block or None)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        g = prof.runcall(go)
        stats = pstats.Stats(prof, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(
            r"kvstrata[/\\](read|hf|codecs)", args.profile)  # ours, by total
    else:
        g = go()
    if args.json:
        row = {
            "peak_rss_mb": peak_rss_mb(), "prefill_chunk": args.prefill_chunk, "dtype": args.dtype,
            "store_block": args.store_block, "text": g.text,
            "method": str(spec), "model": args.model, "context_tokens": g.context_tokens,
            "new_tokens": len(g.new_tokens), "kv_bytes": g.kv_bytes,
            "kv_bytes_per_token": g.kv_bytes_per_token,
            "kv_bytes_per_token_bf16": g.kv_bytes_per_token_bf16,
            "compression_vs_bf16": g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token
            if g.kv_bytes_per_token
            else None,
        }
        print(json.dumps(row))
    else:
        print(g.text)
        ratio = g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token if g.kv_bytes_per_token else float("nan")
        print(
            f"\n[{spec}] context {g.context_tokens} tokens; KV {g.kv_bytes_per_token:,.1f} B/token vs bf16 "
            f"{g.kv_bytes_per_token_bf16:,.1f} B/token ({ratio:.2f}x smaller)",
            file=sys.stderr,
        )
    return 0
