"""The measurement subcommands behind docs/ and docs/results: the store's evidence, depth similarity
and ablation, top-k overlap, the V4.1 prefill and reference training, the kernel and memory
benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.cli.inputs import (
    BIG,
    SEED,
    check_context,
    csv_items,
    int_in,
    length_arg,
    split_methods,
    writable_dir,
)
from kvstrata.settings import DTYPES


def register(sub) -> None:
    sb = sub.add_parser("store-bench", help="persistent-store evidence: replay error, TTFT, tier throughput")
    sb.add_argument("--model", default="gemma3-270m")
    sb.add_argument("--tokens", type=int_in(64, BIG), default=8192,
                    help="prompt length, within the model's context")
    sb.add_argument("--method", default="bf16")
    sb.add_argument("--out", default="docs/results/store")
    sb.set_defaults(func=cmd_store_bench)

    rc = sub.add_parser("replay-check", help="hit, bounded replays (1/2/4 windows) and exact replay against "
                                             "a cold run: KL, greedy agreement, TTFT")
    rc.add_argument("--model", default="gemma3-270m")
    rc.add_argument("--method", default="bf16")
    rc.add_argument("--prompts", type=int_in(1, 10_000), default=3, help="random prompts (natural text)")
    rc.add_argument("--tokens", type=int_in(2, BIG), default=2048, help="each prompt's length")
    rc.add_argument("--splits", type=int_in(1, 10_000), default=2,
                    help="random split points per prompt (where the turn before ended)")
    rc.add_argument("--turn-tokens", type=int_in(1, BIG), default=64,
                    help="tokens the turn after the split adds")
    rc.add_argument("--new-tokens", type=int_in(1, 100_000), default=16,
                    help="decode steps compared with the cold run's")
    rc.add_argument("--windows", default="1,2,4",
                    help="bounded replays, in sliding windows (comma-separated)")
    rc.add_argument("--block", type=int_in(1, 1 << 20), default=256, help="tokens per stored block")
    rc.add_argument("--seed", type=SEED, default=0)
    rc.add_argument("--out", default="docs/results/replay-check")
    rc.set_defaults(func=cmd_replay_check)

    ds = sub.add_parser("depth-similarity", help="adjacent-layer KV similarity per head (heat maps)")
    ds.add_argument("--model", default="smollm2-135m,gemma3-270m")
    ds.add_argument("--tokens", type=int_in(16, BIG), default=2048, help="prompt length")
    ds.add_argument("--group", type=int_in(2, 64), default=4, help="adjacent layers per depth group (G)")
    ds.add_argument("--out", default="docs/results/depth")
    ds.set_defaults(func=cmd_depth_similarity)

    da = sub.add_parser("depth-ablation", help="FreqDepthKV G / F / r / tolerance / norm swept in the bench")
    da.add_argument("--model", default="smollm2-135m")
    da.add_argument("--length", type=int_in(64, BIG), default=2048, help="context length in tokens")
    da.add_argument("--n", type=int_in(1, 100_000), default=3, help="instances per task")
    da.add_argument("--methods", help="comma-separated specs (default: the built-in grid, bf16 first)")
    da.add_argument("--out", default="docs/results", help="bench directory; rows go to OUT/depth-ablation")
    da.set_defaults(func=cmd_depth_ablation)

    to = sub.add_parser("topk-overlap", help="top-k overlap between layers (evidence for Reuse schedules)")
    to.add_argument("--model", default="smollm2-135m,gemma3-270m")
    to.add_argument("--tokens", type=int_in(16, BIG), default=4096, help="prompt length")
    to.add_argument("--k", type=int_in(1, BIG), default=256, help="at most --tokens")
    to.add_argument("--out", default="docs/results/read")
    to.set_defaults(func=cmd_topk_overlap)

    vp = sub.add_parser("v41-prefill", help="V4.1 half-depth (CED) prefill vs the same-size full-depth model")
    vp.add_argument("--preset", default="small-v41", help="V4.1 preset (tiny-v41, small-v41)")
    vp.add_argument("--factor", type=int_in(1, 1024), default=16, help="prompt length in units of n_win")
    vp.add_argument("--repeats", type=int_in(1, 1000), default=5, help="timed runs (the median is kept)")
    vp.add_argument("--out", help="write the measurement as JSON here")
    vp.set_defaults(func=cmd_v41_prefill)

    tr = sub.add_parser("train-ref", help="train tiny V4.1 and a same-size dense transformer on recall")
    tr.add_argument("--preset", default="tiny-v41", help="V4.1 preset of both models' shape")
    tr.add_argument("--steps", type=int_in(1, 10**7), default=1500, help="training steps")
    tr.add_argument("--batch", type=int_in(1, 1 << 16), default=32, help="sequences per step")
    tr.add_argument("--seq-len", type=int_in(8, 1 << 16), default=64, help="tokens per sequence")
    tr.add_argument("--pairs", type=int_in(1, 1024), default=4, help="key-value pairs to recall per sequence")
    tr.add_argument("--seed", type=SEED, default=0)
    tr.add_argument("--eval-sequences", type=int_in(1, 10**7), default=256, help="held-out sequences scored")
    tr.add_argument("--override", help="JSON object of V41Config fields for both models, e.g. "
                    "'{\"layer_modes\": [\"full\", ...], \"compress\": [1, ...]}'")
    tr.add_argument("--out", default="runs/train-ref")
    tr.set_defaults(func=cmd_train_ref)

    kb = sub.add_parser("kernels-bench",
                        help="decode attention from encoded KV vs SDPA, 2k-64k tokens, + copy bandwidth")
    kb.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536",
                    help="comma-separated cached tokens")
    kb.add_argument("--shapes", default="smollm2-135m,gemma3-270m",
                    help="whose head shapes: smollm2-135m, gemma3-270m, "
                         "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    kb.add_argument("--repeats", type=int_in(1, 1000), default=9,
                    help="timed runs per point (the median is kept)")
    kb.add_argument("--out", default="docs/results/kernels")
    kb.set_defaults(func=cmd_kernels_bench)

    st = sub.add_parser("step-bench",
                        help="one batched decode step in process at 1 and N rows, and its profile")
    st.add_argument("--model", default="smollm2-135m")
    st.add_argument("--methods", default="bf16,nvfp4", help="comma-separated specs")
    st.add_argument("--rows", type=int_in(2, 256), default=8,
                    help="rows (running requests) of the batched step")
    st.add_argument("--prompt-tokens", type=int_in(1, BIG), default=128, help="tokens each row's cache holds")
    st.add_argument("--rounds", type=int_in(1, 1000), default=5,
                    help="interleaved timing rounds (medians kept)")
    st.add_argument("--steps", type=int_in(1, 10_000), default=6, help="steps timed per round")
    st.add_argument("--dtype", choices=DTYPES, default="float32", help="the model's weights and activations")
    st.add_argument("--python-encode", action="store_true",
                    help="also time each NVFP4 method with the PyTorch encode (the same codes)")
    st.add_argument("--torch-linear", action="store_true",
                    help="also time each method with torch's linear layers instead of the kernel's")
    st.add_argument("--out", default="docs/results/step")
    st.set_defaults(func=cmd_step_bench)

    mb = sub.add_parser("memory-bench",
                        help="peak RSS of `generate` on a long prompt vs the KV it holds, per codec")
    mb.add_argument("--model", default="smollm2-135m")
    mb.add_argument("--tokens", type=int_in(16, BIG), default=8000,
                    help="prompt tokens (with 8 new ones, within the context)")
    mb.add_argument("--methods", default="bf16,fp8,int4:r=32,int2:r=32,mxfp4,nvfp4",
                    help="comma-separated specs")
    mb.add_argument("--chunks", default="512,0", help="comma-separated --prefill-chunk values (0 = one pass)")
    mb.add_argument("--out", default="docs/results/kernels")
    mb.set_defaults(func=cmd_memory_bench)

    sc = sub.add_parser("scaling-bench",
                        help="decode time and peak memory against the context, each point in its own process")
    sc.add_argument("--model", default="gemma3-270m")
    sc.add_argument("--lengths", default=None,
                    help="comma-separated context lengths (default: 2k..32k on gemma3-270m, else 2k..8k)")
    sc.add_argument("--methods", default=None,
                    help="comma-separated specs; `dynamic` / `static` are transformers' own caches "
                         "(default: dynamic, static, bf16, fp8, nvfp4, int4:r=32 and a lowrank top-k)")
    sc.add_argument("--new-tokens", type=int_in(2, 10_000), default=16,
                    help="decode steps per point (the first is timed apart)")
    sc.add_argument("--out", default="docs/results/scaling")
    sc.add_argument("--work", default=None,
                    help="where each length's saved prefill is kept (default: $KVSTRATA_CACHE/scaling)")
    sc.set_defaults(func=cmd_scaling_bench)


def cmd_scaling_bench(args) -> int:
    from kvstrata.models import check_method
    from kvstrata_lab.bench import scaling
    from kvstrata_lab.bench.config import STOCK

    lengths = ([length_arg(x, "--lengths") for x in csv_items(args.lengths)] if args.lengths
               else list(scaling.LENGTHS.get(args.model, scaling.LENGTHS["smollm2-135m"])))
    methods = split_methods(args.methods) if args.methods else list(scaling.METHODS)
    for m in methods:
        if m not in STOCK:
            check_method(args.model, m)
    check_context(args.model, max(lengths) + args.new_tokens + 1, "--lengths (+ --new-tokens)")
    writable_dir(args.out, "--out")
    work = writable_dir(args.work, "--work") if args.work else None
    path = scaling.run(args.model, tuple(lengths), tuple(methods), Path(args.out), args.new_tokens, work)
    print(f"results: {path}")
    return 0


def cmd_store_bench(args) -> int:
    from kvstrata.models import check_method
    from kvstrata_lab.bench.store_evidence import run

    check_method(args.model, args.method, store=True)  # the evidence serves through the store
    check_context(args.model, args.tokens + 32, "--tokens (+ 32 continuation tokens)")
    result = run(args.model, args.tokens, Path(args.out), args.method)
    print(json.dumps(result, indent=1))
    return 0


def cmd_replay_check(args) -> int:
    from kvstrata.models import check_method
    from kvstrata_lab.bench.replay_check import ReplayCheckConfig, run

    check_method(args.model, args.method, store=True)  # every mode serves through the store
    if args.tokens - args.turn_tokens <= args.block:
        raise ValueError(f"--tokens {args.tokens}: minus --turn-tokens {args.turn_tokens}, the turn before "
                         f"the split must be longer than one {args.block}-token block to be stored")
    check_context(args.model, args.tokens + args.new_tokens, "--tokens (+ --new-tokens)")
    windows = tuple(int(w) if w.isdigit() and int(w) >= 1 else 0 for w in csv_items(args.windows))
    if not windows or 0 in windows:
        raise ValueError(f"--windows: expected whole numbers of sliding windows >= 1, got {args.windows!r}")
    cfg = ReplayCheckConfig(model=args.model, method=args.method, prompts=args.prompts, tokens=args.tokens,
                            splits=args.splits, turn_tokens=args.turn_tokens, new_tokens=args.new_tokens,
                            windows=windows, block=args.block, seed=args.seed)
    run(cfg, Path(args.out))
    print((Path(args.out) / "replay_check.md").read_text(), end="")
    return 0


def cmd_depth_similarity(args) -> int:
    from kvstrata_lab.bench.depth_similarity import run

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
    from kvstrata_lab.bench import depth_ablation
    from kvstrata_lab.bench.report import write_report
    from kvstrata_lab.bench.results import ReportInput
    from kvstrata_lab.bench.runner import run

    methods = split_methods(args.methods) if args.methods else depth_ablation.GRID
    cfg = depth_ablation.config(args.model, args.length, args.n, Path(args.out), tuple(methods))
    run(cfg)
    print(depth_ablation.report_section(ReportInput(Path(args.out))))
    if (Path(args.out) / "results.jsonl").exists():
        print(f"report: {write_report(Path(args.out))}")
    return 0


def cmd_topk_overlap(args) -> int:
    from kvstrata_lab.bench.topk_overlap import run

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
    from kvstrata_lab.bench.v41_prefill import run

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
    from kvstrata_lab.v41_train import TrainConfig, run

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
    from kvstrata_lab.bench import kernels

    lengths = [length_arg(x, "--lengths") for x in csv_items(args.lengths)]
    shapes = csv_items(args.shapes)
    for s in shapes:
        if s not in kernels.SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r} (known: {', '.join(kernels.SHAPES)})")
    path = kernels.run(Path(args.out), tuple(lengths), tuple(shapes), args.repeats)
    print(f"results: {path}")
    return 0


def cmd_step_bench(args) -> int:
    from kvstrata.models import check_method
    from kvstrata_lab.bench import step

    methods = csv_items(args.methods)
    for m in methods:
        check_method(args.model, m)
    path = step.run(args.model, methods, args.rows, args.prompt_tokens, args.rounds, args.steps,
                    Path(args.out), args.dtype, args.python_encode, args.torch_linear)
    print(f"results: {path}")
    return 0


def cmd_memory_bench(args) -> int:
    from kvstrata.models import check_method
    from kvstrata_lab.bench import memory

    methods = split_methods(args.methods)
    for m in methods:
        check_method(args.model, m)
    chunks = []
    for x in csv_items(args.chunks):
        if not x.isdigit():
            raise ValueError(f"--chunks: {x!r} is not a whole number of tokens (0 = one pass)")
        chunks.append(int(x))
    check_context(args.model, args.tokens + 8, "--tokens")
    print(f"results: {memory.run(args.model, args.tokens, methods, chunks, Path(args.out))}")
    return 0
