"""`kvstrata sparse-recall`: the recall of a top-k read's selection against true attention, per
full-attention layer and length, and whether it held the needle (`kvstrata_lab.bench.sparse_recall`)."""

from __future__ import annotations

import shlex
import sys

from kvstrata.cli.inputs import BIG, SEED, csv_items, int_in, length_arg


def register(sub) -> None:
    from kvstrata_lab.bench.config import DEFAULT_METHOD, RecallConfig
    from kvstrata_lab.bench.corpus import KINDS
    from kvstrata_lab.bench.tasks import LOOKALIKE, RETRIEVAL

    d = RecallConfig()
    sr = sub.add_parser("sparse-recall", help="top-k selection vs true attention per layer, 2k-32k: "
                        "recall@k, attention mass kept, needle in selection (JSON, table, plots)")
    sr.add_argument("--model", default=d.model)
    sr.add_argument("--method", default=DEFAULT_METHOD, help="a topk read over the bf16 store")
    sr.add_argument("--lengths", default=",".join(map(str, d.lengths)), help="comma-separated prompt tokens")
    sr.add_argument("--prompts", type=int_in(1, 1000), default=d.prompts, help="needle prompts per length")
    sr.add_argument("--task", default=d.task, choices=RETRIEVAL + LOOKALIKE,
                    help="the benchmark task the prompts are instances of")
    sr.add_argument("--chunk", type=int_in(1, BIG), default=d.chunk, help="prefill tokens per forward pass")
    sr.add_argument("--threads", type=int_in(1, 1024), default=d.threads, help="torch CPU threads")
    sr.add_argument("--seed", type=SEED, default=d.seed)
    sr.add_argument("--haystack", default=d.haystack, choices=KINDS)
    sr.add_argument("--out", default="docs/results/sparse-recall")
    sr.set_defaults(func=cmd_sparse_recall)


def cmd_sparse_recall(args) -> int:
    from pathlib import Path

    from kvstrata.cli.inputs import check_context, writable_dir
    from kvstrata.models import check_method
    from kvstrata_lab.bench.sparse_recall import RESERVE, RecallConfig, read_config, run

    lengths = tuple(length_arg(x, "--lengths") for x in csv_items(args.lengths))
    if not lengths:
        raise ValueError(f"--lengths: expected comma-separated token counts, got {args.lengths!r}")
    read_config(args.method)
    check_method(args.model, args.method)
    for n in lengths:
        check_context(args.model, n, "--lengths")
        if n <= 4 * RESERVE:
            raise ValueError(f"--lengths: {n} tokens leave no room for a needle prompt")
    cfg = RecallConfig(model=args.model, method=args.method, lengths=lengths, prompts=args.prompts,
                       task=args.task, chunk=args.chunk, seed=args.seed, haystack=args.haystack,
                       threads=args.threads)
    out = writable_dir(args.out, "--out")
    command = "kvstrata " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["sparse-recall"] else ""
    result = run(cfg, Path(out), command or _command(cfg, out))
    print((Path(out) / "sparse_recall.md").read_text(), end="")
    print(f"JSON and plots in {out}; {len(result['records'])} records")
    return 0


def _command(cfg, out) -> str:
    """The command line that reproduces `cfg` (when not run from a shell's argv)."""
    return (f"kvstrata sparse-recall --model {cfg.model} --method {shlex.quote(cfg.method)} "
            f"--lengths {','.join(map(str, cfg.lengths))} --prompts {cfg.prompts} --task {cfg.task} "
            f"--chunk {cfg.chunk} --seed {cfg.seed} --out {out}")
