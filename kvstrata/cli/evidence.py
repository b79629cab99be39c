"""The measurement subcommands behind docs/ and docs/results: depth similarity and ablation, top-k overlap,
the V4.1 prefill and reference training, the kernel and memory benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.cli.inputs import check_context, csv_items, length_arg, parse_method_early, split_methods


def cmd_depth_similarity(args) -> int:
    from kvstrata.bench.depth_similarity import run

    for name in csv_items(args.model):
        check_context(name, args.tokens, "--tokens")
    results = run(list(csv_items(args.model)), args.tokens, args.group, Path(args.out))
    for name, r in results.items():
        mean = lambda rows: sum(map(sum, rows)) / sum(map(len, rows))  # noqa: E731
        print(
            f"{name}: mean adjacent cosine K {mean(r['k_cos']):.3f} V {mean(r['v_cos']):.3f}; "
            f"lowest-frequency energy (G={r['group']}) K {mean(r['k_low']):.3f} V {mean(r['v_low']):.3f}"
        )
    print(f"plots and JSON in {args.out}")
    return 0


def cmd_depth_ablation(args) -> int:
    from kvstrata.bench import depth_ablation
    from kvstrata.bench.report import write_report
    from kvstrata.bench.results import ReportInput
    from kvstrata.bench.runner import run

    methods = split_methods(args.methods) if args.methods else depth_ablation.GRID
    cfg = depth_ablation.config(args.model, args.length, args.n, Path(args.out), tuple(methods))
    run(cfg)
    print(depth_ablation.report_section(ReportInput(Path(args.out))))
    if (Path(args.out) / "results.jsonl").exists():
        print(f"report: {write_report(Path(args.out))}")
    return 0


def cmd_topk_overlap(args) -> int:
    from kvstrata.bench.topk_overlap import run

    if args.k > args.tokens:
        raise ValueError(f"--k: {args.k} is more than --tokens {args.tokens}")
    for name in csv_items(args.model):
        check_context(name, args.tokens, "--tokens")
    for name, r in run(list(csv_items(args.model)), args.tokens, args.k, Path(args.out)).items():
        adj = r["adjacent"]
        print(
            f"{name}: mean top-{r['k']} overlap of adjacent full-attention layers "
            f"{sum(adj) / max(len(adj), 1):.3f}"
        )
    return 0


def cmd_v41_prefill(args) -> int:
    from kvstrata.bench.v41_prefill import run

    r = run(args.preset, args.factor, args.repeats)
    print(
        f"{r['preset']}: {r['prompt_tokens']} prompt tokens (= {args.factor} x n_win {r['n_win']}), "
        f"{r['layers']} layers: half-depth prefill {r['ced_prefill_s']:.3f} s, full-depth "
        f"{r['full_depth_prefill_s']:.3f} s, ratio {r['ratio']:.3f}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0


def _overrides(text: str | None) -> dict:
    """`--override` JSON, refused with a clear message unless it is an object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override is not valid JSON ({exc.msg} at char {exc.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--override must be a JSON object of V41Config fields, got {type(value).__name__}")
    return value


def cmd_train_ref(args) -> int:
    from kvstrata.models.v41.train import TrainConfig, run

    r = run(
        TrainConfig(
            preset=args.preset, steps=args.steps, batch=args.batch, seq_len=args.seq_len, pairs=args.pairs,
            seed=args.seed, eval_sequences=args.eval_sequences, overrides=_overrides(args.override),
        ),
        Path(args.out),
    )
    for name, m in r["models"].items():
        extra = (
            f", from the FP4 cache after half-depth prefill {m['recall_cached_fp4']:.3f}"
            if "recall_cached_fp4" in m
            else ""
        )
        print(
            f"{name}: recall {m['recall']:.3f}{extra} (loss {m['final_loss']:.3f}, {m['seconds']:.0f} s, "
            f"{m['parameters']:,} params)"
        )
    print(f"checkpoints and train_ref.json in {args.out}")
    return 0


def cmd_kernels_bench(args) -> int:
    from kvstrata.bench import kernels

    lengths = [length_arg(x, "--lengths") for x in csv_items(args.lengths)]
    shapes = csv_items(args.shapes)
    for s in shapes:
        if s not in kernels.SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r} (known: {', '.join(kernels.SHAPES)})")
    path = kernels.run(Path(args.out), tuple(lengths), tuple(shapes), args.repeats)
    print(f"results: {path}")
    return 0


def cmd_memory_bench(args) -> int:
    from kvstrata.bench import memory
    from kvstrata.models.loader import check as check_model

    methods = split_methods(args.methods)
    for m in methods:
        parse_method_early(m)
    chunks = []
    for x in csv_items(args.chunks):
        if not x.isdigit():
            raise ValueError(f"--chunks: {x!r} is not a whole number of tokens (0 = one pass)")
        chunks.append(int(x))
    check_model(args.model)
    check_context(args.model, args.tokens + 8, "--tokens")
    print(f"results: {memory.run(args.model, args.tokens, methods, chunks, Path(args.out))}")
    return 0
