"""What each `kvstrata` subcommand does (the parser lives in `kvstrata.cli`)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from kvstrata.cli.inputs import check_context, csv_items, length_arg, parse_method_early, split_methods


def cmd_methods(args) -> int:
    from kvstrata.cli.methods_doc import defaults, markdown
    from kvstrata.registry import STRATA, entries

    if args.markdown:
        print(markdown(), end="")
        return 0
    for entry in (e for stratum in STRATA for e in entries(stratum)):
        params = ",".join(f"{k}={v}" for k, v in defaults(entry.name).items())
        print(f"{entry.name:<10} {entry.stratum:<6} {entry.summary}  [{params}]")
    return 0


def cmd_models(args) -> int:
    from kvstrata.models import KNOWN_MODELS, TINY_MODELS
    from kvstrata.models.loader import COMPLETE_MARK, converted_path

    for m in KNOWN_MODELS.values():
        state = "installed" if m.installed() else f"missing ({m.install_command})"
        if (converted_path(m.name) / COMPLETE_MARK).exists():
            state += ", converted"
        print(f"{m.name:<14} {state}\n  {m.description}")
    for t in TINY_MODELS.values():
        print(f"{t.name:<14} built in: random weights for smoke tests, written on first use\n  "
              f"{t.description}")
    return 0


def cmd_generate(args) -> int:
    from kvstrata.bench.protocol import peak_rss_mb
    from kvstrata.cli.inputs import check_fits, prompt_text
    from kvstrata.hf.run import generate
    from kvstrata.methods import parse_method
    from kvstrata.models import load

    spec = parse_method(args.method)  # fail fast, before the model loads
    prompt = prompt_text(args.prompt, args.prompt_file)
    model, tok = load(args.model)
    ids = tok(prompt, return_tensors="pt").input_ids
    check_fits(model, ids.shape[1], args.max_new_tokens)
    run = functools.partial(generate, model, tok, ids, spec, args.max_new_tokens,
                            prefill_chunk=args.prefill_chunk or None)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        g = prof.runcall(run)
        stats = pstats.Stats(prof, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(
            r"kvstrata[/\\](read|hf|codecs)", args.profile)  # ours, by total
    else:
        g = run()
    if args.json:
        row = {
            "peak_rss_mb": peak_rss_mb(), "prefill_chunk": args.prefill_chunk, "text": g.text,
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


def cmd_passkey(args) -> int:
    from kvstrata.bench.passkey import passkey_prompt
    from kvstrata.cli.inputs import check_fits
    from kvstrata.hf.run import generate
    from kvstrata.methods import parse_method
    from kvstrata.models import load

    specs = [parse_method(m) for m in args.methods.split("|")]
    check_context(args.model, args.tokens, "--tokens")
    model, tok = load(args.model)
    p = passkey_prompt(tok, args.tokens, args.depth, seed=args.seed)
    ids = tok(p.context + p.question, return_tensors="pt").input_ids
    check_fits(model, ids.shape[1], 8, "the passkey prompt", "the answer")
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


def cmd_bench(args) -> int:
    from kvstrata.bench.peers import DEFAULT_PEERS, parse_peer
    from kvstrata.bench.report import write_report
    from kvstrata.bench.runner import DEFAULT_METHODS, QUICK, BenchConfig, run
    from kvstrata.bench.tasks import TASKS
    from kvstrata.methods import parse_method
    from kvstrata.models.loader import check as check_model

    q = QUICK if args.quick else {}
    if args.methods == "none":
        methods = []
    else:
        methods = split_methods(args.methods) if args.methods else q.get("methods", DEFAULT_METHODS)
    for m in methods:
        if m != "dynamic":
            parse_method(m)  # fail before any model loads
    peers = () if args.peers is None else DEFAULT_PEERS if args.peers == "default" else csv_items(args.peers)
    for p in peers:
        parse_peer(p)
    models = csv_items(args.model) if args.model else q.get("models", ("smollm2-135m",))
    lengths = (
        tuple(length_arg(x, "--lengths") for x in csv_items(args.lengths))
        if args.lengths
        else q.get("lengths", (2048,))
    )
    pairs = []  # model@L1/L2 picks lengths per model
    for m in models:
        name, _, own = m.partition("@")
        check_model(name)  # fail before any model loads
        pairs += (
            [(name, length_arg(x, f"--model {m}")) for x in own.split("/")]
            if own
            else [(name, L) for L in lengths]
        )
    for name, L in pairs:
        check_context(name, L, "--lengths" if not args.model or "@" not in args.model else "--model")
    cfg = BenchConfig(
        models=tuple(p[0] for p in pairs),
        lengths=lengths,
        pairs=tuple(pairs),
        tasks=csv_items(args.tasks) if args.tasks else TASKS,
        methods=tuple(methods),
        n=args.n if args.n is not None else q.get("n", 20),
        seed=args.seed,
        haystack=args.haystack,
        out=Path(args.out),
        peers=tuple(peers),
    )
    path = run(cfg)
    print(f"results: {path}")
    print(f"report:  {write_report(cfg.out)}")
    return 0


def cmd_tune(args) -> int:
    from kvstrata.bench.tasks import RETRIEVAL
    from kvstrata.bench.tune import DEFAULT_LADDER, TuneConfig, check_plain, tune
    from kvstrata.bench.tune_keep import check_keep, tune_keep
    from kvstrata.models.loader import check as check_model

    cfg = TuneConfig(
        model=args.model, length=args.length,
        ladder=tuple(split_methods(args.ladder)) if args.ladder else DEFAULT_LADDER,
        tasks=csv_items(args.tasks) if args.tasks else RETRIEVAL, calib=_indices(args.calib, "--calib"),
        heldout=_indices(args.heldout, "--heldout"), max_drop=args.max_drop, top1=args.top1, bytes=args.bytes,
        seed=args.seed, haystack=args.haystack, kv_apart=args.kv_apart, layer_keep=args.layer_keep,
        out=Path(args.out),
    )
    if args.keep:  # before any model loads
        check_keep(cfg, args.keep)
    else:
        check_plain(cfg)
    check_model(args.model)
    check_context(args.model, args.length, "--length")
    cert = tune_keep(cfg, args.keep) if args.keep else tune(cfg)
    held = cert["heldout"]
    delta = held["delta_vs_bf16"]
    print(f"spec: {cert['spec']}")
    ci = "" if not delta else (f" (Δ {delta['mean']:+.2f}, 95 % CI [{delta['ci95'][0]:+.2f}, "
                               f"{delta['ci95'][1]:+.2f}])")
    print(f"held-out ({len(held['indices'])} per task, {held['n_questions']} questions): "
          f"{held['compression']:.2f}× smaller, retrieval {_num(held['retrieval'])} vs bf16 "
          f"{_num(held['bf16_retrieval'])}{ci}, top-1 {held['top1']:.3f}")
    print(f"certificate: {cfg.out / 'certificate.json'}")
    met = cert["quality_met_on_calibration"] and cert["heldout_quality_met"]
    met = met and cert["bytes_met"] is not False
    if not met:
        print("budget not met (see the certificate's calibration / heldout / bytes_met)", file=sys.stderr)
    return 0 if met else 1


def _num(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _indices(text: str, flag: str) -> tuple[int, ...]:
    """`100-103,110` -> (100, 101, 102, 103, 110), or a clear error naming the flag."""
    from kvstrata.methods import parse_ranges

    return parse_ranges(text, flag, "an instance index", 10**6)


def cmd_report(args) -> int:
    from kvstrata.bench.report import write_report

    print(write_report(Path(args.dir), skip_bad=args.skip_bad))
    return 0


def cmd_check_lengths(args) -> int:
    from kvstrata.bench.lengths import MOVED, check, pending, pending_table, table
    from kvstrata.models import load_tokenizer

    off, total = check(Path(args.dir), load_tokenizer, args.drop, args.seed)
    if off:
        print(table(off))
    where = f"; moved to {Path(args.dir) / MOVED}" if args.drop and off else ""
    print(f"{len(off)} of {total} rows were fed a context their nominal length does not allow{where}")
    moved, left = pending(Path(args.dir))
    if moved:
        print(f"{moved - len(left)} of the {moved} rows in {MOVED} have been rerun at their length"
              + (f"; {len(left)} have not:\n\n{pending_table(left)}" if left else ""))
    return 0


def cmd_accounting(args) -> int:
    from kvstrata import accounting

    if bool(args.preset) == bool(args.model):
        raise ValueError("give exactly one of --preset (v41-flash, v4-flash, tiny-v41, small-v41) or --model")
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
            print(accounting.format_v41(report, plan))
        return 0
    from transformers import AutoConfig

    from kvstrata.methods import parse_method
    from kvstrata.models import resolve

    parse_method(args.method)
    config = AutoConfig.from_pretrained(resolve(args.model), local_files_only=True)
    report = accounting.account_hf(config, args.method, args.tokens)
    print(json.dumps(report, indent=1) if args.json else accounting.format_hf(report, args.model))
    return 0


def cmd_store(args) -> int:
    from kvstrata.place import KVStore, StoreConfig

    store = KVStore.from_config(StoreConfig.load(args.config))
    result = {"stats": store.stats, "verify": store.verify, "gc": store.gc}[args.action]()
    print(json.dumps(result, indent=1))
    return 0


def cmd_store_bench(args) -> int:
    from kvstrata.bench.store_evidence import run

    parse_method_early(args.method)
    check_context(args.model, args.tokens + 32, "--tokens (+ 32 continuation tokens)")
    result = run(args.model, args.tokens, Path(args.out), args.method)
    print(json.dumps(result, indent=1))
    return 0


def cmd_chat(args) -> int:
    from kvstrata.cli.inputs import SCRIPT_MAX_BYTES
    from kvstrata.models import load
    from kvstrata.place import KVStore, StoreConfig
    from kvstrata.place.chat import chat
    from kvstrata.place.prefix_server import PrefixServer
    from kvstrata.textfile import read_text_file

    parse_method_early(args.method)
    cfg = StoreConfig.load(args.config)
    script = read_text_file(args.script, "--script", SCRIPT_MAX_BYTES) if args.script else None
    store = KVStore.from_config(cfg)
    model, tok = load(args.model)
    server = PrefixServer(model, store, args.method, block_size=cfg.block_size, tenant=args.tenant.encode())
    source = script.split("\n---\n") if script is not None else (line for line in sys.stdin)
    turns = [t.strip() for t in source if t.strip()]
    if script is not None and not turns:
        raise ValueError(f"--script: {args.script} holds no turns")
    chat(model, tok, server, turns, args.max_new_tokens, set(args.forget_swa_before or []), out=sys.stdout)
    return 0
