"""`kvstrata bench`, `kvstrata report`, `kvstrata check-lengths`: the benchmark (defaults from
`BenchConfig`), its report, and the rows fed shorter than their nominal length."""

from __future__ import annotations

import sys
from pathlib import Path

from kvstrata.cli.inputs import SEED, field_default, int_in
from kvstrata.settings import DTYPES
from kvstrata_lab.bench.config import STOCK, BenchConfig


def register(sub) -> None:
    def default(name: str):
        return field_default(BenchConfig, name)

    b = sub.add_parser("bench", help="run the benchmark (resumable) and write its report")
    b.add_argument("--model", help="comma-separated models, each optionally @L1/L2 for its own lengths "
                   f"(e.g. smollm2-135m@2048/4096,gemma3-270m@4096; default {','.join(default('models'))})")
    b.add_argument("--methods", help="comma-separated method specs (default: the first table's methods; "
                   "'none' to run only --peers)")
    b.add_argument("--peers", help="comma-separated peer specs run on the same instances, or 'default': "
                   "kvpress:<press>:cr=<ratio> (own environment, created on first use) and "
                   "qcache:<quanto|hqq>:int<2|4> (transformers' QuantizedCache)")
    b.add_argument("--tasks", help=f"comma-separated tasks (default {','.join(default('tasks'))}; "
                   "lookalike on request: other needle phrasings among lookalike distractors;"
                   " calib / report: "
                   "the text families, docs/benchmark.md#text-families)")
    b.add_argument("--lengths", help="comma-separated context lengths in tokens (default "
                   f"{','.join(map(str, default('lengths')))})")
    b.add_argument("--n", type=int_in(1, 100_000),
                   help=f"instances per task and length (default {default('n')})")
    b.add_argument("--seed", type=SEED, default=default("seed"))
    b.add_argument("--haystack", default=default("haystack"), choices=("noise", "natural"))
    b.add_argument("--out", default=str(default("out")))
    b.add_argument("--dtype", choices=DTYPES, default=default("dtype"),
                   help="the models' weights and activations (bf16: fast on CPUs with AVX512-BF16); rows "
                        "record it, and one --out holds one dtype's rows")
    b.add_argument("--quick", action="store_true",
                   help="SmolLM2-135M, 2k, 2 instances per task, 8 methods (12 cells, ~2.5 min alone)")
    b.set_defaults(func=bench)

    rp = sub.add_parser("report", help="write report.md / plots / report.html for a bench directory")
    rp.add_argument("dir", help="a bench output directory (its results.jsonl)")
    rp.add_argument("--skip-bad", action="store_true",
                    help="leave out malformed rows of results.jsonl (counted in the report) instead of "
                         "refusing the file")
    rp.add_argument("--decode-from", metavar="DIR",
                    help="time the headline's decode column (× the fastest stock row) with DIR's rows: a "
                         "speed run on the same tasks that ran `static` beside `dynamic`; remembered in "
                         "meta.json")
    rp.set_defaults(func=report)

    cl = sub.add_parser("check-lengths", help="list a bench directory's rows not fed at their nominal length")
    cl.add_argument("dir", help="a bench output directory (its results.jsonl)")
    cl.add_argument("--drop", action="store_true",
                    help="move them to DIR/short-rows.jsonl; rerunning their bench commands then redoes them")
    cl.add_argument("--seed", type=int, help="the runs' seed (default: from DIR/meta.json)")
    cl.set_defaults(func=check_lengths)


def bench(args) -> int:
    from kvstrata.cli.inputs import csv_items, model_name

    for m in csv_items(args.model or ""):
        model_name(m.partition("@")[0], f"--model {m}")  # a mistyped model is named at once (no torch)

    from kvstrata.cli.inputs import check_context, length_arg, split_methods, writable_dir
    from kvstrata.methods import parse_method
    from kvstrata.models import check_method
    from kvstrata.models.loader import check as check_model
    from kvstrata_lab.bench.config import QUICK
    from kvstrata_lab.bench.peers import DEFAULT_PEERS, parse_peer
    from kvstrata_lab.bench.report import write_report
    from kvstrata_lab.bench.runner import run

    base = BenchConfig()
    q = QUICK if args.quick else {}
    if args.methods == "none":
        methods = []
    else:
        methods = split_methods(args.methods) if args.methods else q.get("methods", base.methods)
    for m in methods:
        if m not in STOCK:
            parse_method(m)  # fail before any model loads
    peers = () if args.peers is None else DEFAULT_PEERS if args.peers == "default" else csv_items(args.peers)
    for p in peers:
        parse_peer(p)
    models = csv_items(args.model) if args.model else q.get("models", base.models)
    lengths = (
        tuple(length_arg(x, "--lengths") for x in csv_items(args.lengths))
        if args.lengths
        else q.get("lengths", base.lengths)
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
    for name in dict.fromkeys(p[0] for p in pairs):
        for m in methods:
            if m not in STOCK:
                check_method(name, m)  # a spec this model's shape cannot take
    cfg = BenchConfig(
        models=tuple(p[0] for p in pairs),
        lengths=lengths,
        pairs=tuple(pairs),
        tasks=csv_items(args.tasks) if args.tasks else base.tasks,
        methods=tuple(methods),
        n=args.n if args.n is not None else q.get("n", base.n),
        seed=args.seed,
        haystack=args.haystack,
        out=writable_dir(args.out, "--out"),
        peers=tuple(peers),
        dtype=args.dtype,
    )
    try:
        path = run(cfg)
    except KeyboardInterrupt:
        kept = cfg.out / "results.jsonl"
        rows = sum(1 for line in kept.open() if line.strip()) if kept.exists() else 0
        print(f"\nkvstrata bench: interrupted; {rows} finished rows kept in {kept} (the cell under way is "
              "redone); rerun the same command to resume", file=sys.stderr)
        return 130
    print(f"results: {path}")
    print(f"report:  {write_report(cfg.out)}")
    return 0


def report(args) -> int:
    from kvstrata_lab.bench.report import write_report

    decode_from = Path(args.decode_from) if args.decode_from else None
    print(write_report(Path(args.dir), skip_bad=args.skip_bad, decode_from=decode_from))
    return 0


def check_lengths(args) -> int:
    from kvstrata.models import load_tokenizer
    from kvstrata_lab.bench.lengths import MOVED, check, pending, pending_table, table

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
