"""`kvstrata` command line: the parser and entry point; `commands` and `evidence` (the measurement
subcommands) hold what each subcommand does."""

from __future__ import annotations

import argparse
import sys

from kvstrata.cli import commands as c
from kvstrata.cli import evidence as e
from kvstrata.cli import serve
from kvstrata.cli.inputs import BIG, SEED, float_in, int_in, nonempty


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line `kvstrata: error: ...` and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"kvstrata: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvstrata", description="KV-cache compression, measured on real models.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with a compressed KV cache")
    g.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, or a local model directory")
    g.add_argument("--method", default="bf16", type=nonempty,
                   help="method spec, e.g. nvfp4:r=64 or nvfp4;sliding=fp8")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=nonempty)
    src.add_argument("--prompt-file", help="a UTF-8 text file (at most 16 MiB)")
    g.add_argument("--max-new-tokens", type=int_in(1, BIG), default=32,
                   help="with the prompt, within the model's context")
    g.add_argument("--prefill-chunk", type=int_in(0, BIG), default=512,
                   help="prompt tokens per prefill pass (bounds the prefill's transient memory; 0 = one "
                        "pass)")
    g.add_argument("--profile", type=int_in(1, 200), metavar="N",
                   help="print to stderr the N functions with the most self time, then kvstrata's N with the "
                        "most total time (cProfile)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=c.cmd_generate)

    pk = sub.add_parser("passkey", help="answer a long-context passkey prompt through compressed caches")
    pk.add_argument("--model", required=True)
    pk.add_argument("--methods", default="bf16|nvfp4|mxfp4", type=nonempty, help="'|'-separated method specs")
    pk.add_argument("--tokens", type=int_in(128, BIG), default=4000,
                    help="context length, within the model's")
    pk.add_argument("--depth", type=float_in(0, 1), default=0.5, help="relative position of the needle, 0..1")
    pk.add_argument("--seed", type=SEED, default=0)
    pk.set_defaults(func=c.cmd_passkey)

    b = sub.add_parser("bench", help="run the benchmark (resumable) and write its report")
    b.add_argument("--model", help="comma-separated models, each optionally @L1/L2 for its own lengths "
                   "(e.g. smollm2-135m@2048/4096,gemma3-270m@4096; default smollm2-135m)")
    b.add_argument("--methods", help="comma-separated method specs (default: the first table's methods; "
                   "'none' to run only --peers)")
    b.add_argument("--peers", help="comma-separated peer specs run on the same instances, or 'default': "
                   "kvpress:<press>:cr=<ratio> (own environment, created on first use) and "
                   "qcache:<quanto|hqq>:int<2|4> (transformers' QuantizedCache)")
    b.add_argument("--tasks",
                   help="comma-separated tasks (default single,multikey,multivalue,multiquery,vartrack,"
                   "fidelity; "
                   "lookalike on request: other needle phrasings among lookalike distractors)")
    b.add_argument("--lengths", help="comma-separated context lengths in tokens (default 2048)")
    b.add_argument("--n", type=int_in(1, 100_000), help="instances per task and length (default 20)")
    b.add_argument("--seed", type=SEED, default=0)
    b.add_argument("--haystack", default="noise", choices=("noise", "natural"))
    b.add_argument("--out", default="runs/bench")
    b.add_argument("--quick", action="store_true",
                   help="SmolLM2-135M, 2k, 2 instances per task, 7 methods (< 10 min)")
    b.set_defaults(func=c.cmd_bench)

    tu = sub.add_parser("tune", help="the cheapest per-layer assignment that keeps a quality budget, "
                        "certified on held-out instances (resumable)")
    tu.add_argument("--model", required=True)
    tu.add_argument("--length", type=int_in(64, BIG), required=True, help="context length in tokens")
    tu.add_argument("--ladder", help="comma-separated recipes, best first (default "
                    "bf16,fp8,nvfp4:rot=hadamard,int2:r=32,rot=hadamard)")
    tu.add_argument("--tasks", help="comma-separated retrieval tasks (default single,multikey,multivalue,"
                    "multiquery)")
    tu.add_argument("--calib", default="100-101", help="calibration instance indices, e.g. 100-103 (default "
                    "100-101; the benchmark reports 0-19)")
    tu.add_argument("--heldout", default="0-3",
                    help="held-out instance indices for the certificate (default 0-3)")
    tu.add_argument("--max-drop", type=float_in(0, 1), default=0.01,
                    help="retrieval (0-1) the spec may lose against bf16 on the same instances")
    tu.add_argument("--top1", type=float_in(0, 1), default=0.97, help="floor on top-1 agreement")
    tu.add_argument("--bytes", type=float_in(1, 1e9), help="target stored bytes per token (checked)")
    tu.add_argument("--seed", type=SEED, default=0)
    tu.add_argument("--haystack", default="noise", choices=("noise", "natural"))
    tu.add_argument("--kv-apart", action="store_true",
                    help="give each layer's keys and values rungs of their own (twice the sensitivity runs)")
    tu.add_argument("--keep", metavar="POLICY",
                    help="trade tokens for bits at --bytes: each rung with the largest keep fraction of "
                    "POLICY (e.g. tova) that fits, the best on calibration certified")
    tu.add_argument("--layer-keep", choices=("uniform", "mass"), default="uniform",
                    help="with --keep: one fraction for every layer, or fractions that lose each layer "
                    "the same share of attention mass on the calibration prompts (mean fitted to --bytes)")
    tu.add_argument("--out", default="runs/tune")
    tu.set_defaults(func=c.cmd_tune)

    rp = sub.add_parser("report", help="write report.md / plots / report.html for a bench directory")
    rp.add_argument("dir")
    rp.add_argument("--skip-bad", action="store_true",
                    help="leave out malformed rows of results.jsonl (counted in the report) instead of "
                         "refusing the file")
    rp.set_defaults(func=c.cmd_report)

    cl = sub.add_parser("check-lengths", help="list a bench directory's rows not fed at their nominal length")
    cl.add_argument("dir")
    cl.add_argument("--drop", action="store_true",
                    help="move them to DIR/short-rows.jsonl; rerunning their bench commands then redoes them")
    cl.add_argument("--seed", type=int, help="the runs' seed (default: from DIR/meta.json)")
    cl.set_defaults(func=c.cmd_check_lengths)

    a = sub.add_parser("accounting", help="bytes per token, per layer: a V4.1 preset or an HF model + method")
    a.add_argument("--preset", help="v41-flash, v4-flash or tiny-v41")
    a.add_argument("--model", help="a known model or a local model directory")
    a.add_argument("--method", default="bf16")
    a.add_argument("--tokens", type=int_in(1, BIG), default=4096, help="context length for HF accounting")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=c.cmd_accounting)

    st = sub.add_parser("store",
                        help="inspect the persistent KV store (config: --config TOML or KVSTRATA_STORE_*)")
    st.add_argument("action", choices=("stats", "verify", "gc"))
    st.add_argument("--config", help="TOML file with a [store] table")
    st.set_defaults(func=c.cmd_store)

    sb = sub.add_parser("store-bench", help="persistent-store evidence: replay error, TTFT, tier throughput")
    sb.add_argument("--model", default="gemma3-270m")
    sb.add_argument("--tokens", type=int_in(64, BIG), default=8192,
                    help="prompt length, within the model's context")
    sb.add_argument("--method", default="bf16")
    sb.add_argument("--out", default="docs/results/store")
    sb.set_defaults(func=c.cmd_store_bench)

    ds = sub.add_parser("depth-similarity", help="adjacent-layer KV similarity per head (heat maps)")
    ds.add_argument("--model", default="smollm2-135m,gemma3-270m")
    ds.add_argument("--tokens", type=int_in(16, BIG), default=2048)
    ds.add_argument("--group", type=int_in(2, 64), default=4)
    ds.add_argument("--out", default="docs/results/depth")
    ds.set_defaults(func=e.cmd_depth_similarity)

    da = sub.add_parser("depth-ablation", help="FreqDepthKV G / F / r / tolerance / norm swept in the bench")
    da.add_argument("--model", default="smollm2-135m")
    da.add_argument("--length", type=int_in(64, BIG), default=2048)
    da.add_argument("--n", type=int_in(1, 100_000), default=3, help="instances per task")
    da.add_argument("--methods", help="comma-separated specs (default: the built-in grid, bf16 first)")
    da.add_argument("--out", default="docs/results", help="bench directory; rows go to OUT/depth-ablation")
    da.set_defaults(func=e.cmd_depth_ablation)

    ch = sub.add_parser("chat",
                        help="multi-turn session over the persistent store: hit / replay / miss per turn")
    ch.add_argument("--model", default="gemma3-270m")
    ch.add_argument("--method", default="nvfp4;sliding=fp8", type=nonempty)
    ch.add_argument("--script",
                    help="UTF-8 file of turns separated by lines of '---' (default: one turn per stdin line)")
    ch.add_argument("--config", help="store TOML ([store] table); env KVSTRATA_STORE_* also apply")
    ch.add_argument("--tenant", default="default", type=nonempty)
    ch.add_argument("--max-new-tokens", type=int_in(1, 100_000), default=32)
    ch.add_argument("--forget-swa-before", type=int_in(1, BIG), nargs="*",
                    help="turn numbers before which the SWA pool is emptied")
    ch.set_defaults(func=c.cmd_chat)

    to = sub.add_parser("topk-overlap", help="top-k overlap between layers (evidence for Reuse schedules)")
    to.add_argument("--model", default="smollm2-135m,gemma3-270m")
    to.add_argument("--tokens", type=int_in(16, BIG), default=4096)
    to.add_argument("--k", type=int_in(1, BIG), default=256, help="at most --tokens")
    to.add_argument("--out", default="docs/results/read")
    to.set_defaults(func=e.cmd_topk_overlap)

    vp = sub.add_parser("v41-prefill", help="V4.1 half-depth (CED) prefill vs the same-size full-depth model")
    vp.add_argument("--preset", default="small-v41")
    vp.add_argument("--factor", type=int_in(1, 1024), default=16, help="prompt length in units of n_win")
    vp.add_argument("--repeats", type=int_in(1, 1000), default=5)
    vp.add_argument("--out", help="write the measurement as JSON here")
    vp.set_defaults(func=e.cmd_v41_prefill)

    tr = sub.add_parser("train-ref", help="train tiny V4.1 and a same-size dense transformer on recall")
    tr.add_argument("--preset", default="tiny-v41")
    tr.add_argument("--steps", type=int_in(1, 10**7), default=1500)
    tr.add_argument("--batch", type=int_in(1, 1 << 16), default=32)
    tr.add_argument("--seq-len", type=int_in(8, 1 << 16), default=64)
    tr.add_argument("--pairs", type=int_in(1, 1024), default=4)
    tr.add_argument("--seed", type=SEED, default=0)
    tr.add_argument("--eval-sequences", type=int_in(1, 10**7), default=256)
    tr.add_argument("--override", help="JSON object of V41Config fields for both models, e.g. "
                    "'{\"layer_modes\": [\"full\", ...], \"compress\": [1, ...]}'")
    tr.add_argument("--out", default="runs/train-ref")
    tr.set_defaults(func=e.cmd_train_ref)

    serve.add_parsers(sub)  # serve, serve-bench
    kb = sub.add_parser("kernels-bench",
                        help="decode attention from encoded KV vs SDPA, 2k-64k tokens, + copy bandwidth")
    kb.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536",
                    help="comma-separated cached tokens")
    kb.add_argument("--shapes", default="smollm2-135m,gemma3-270m",
                    help="whose head shapes: smollm2-135m, gemma3-270m")
    kb.add_argument("--repeats", type=int_in(1, 1000), default=9)
    kb.add_argument("--out", default="docs/results/kernels")
    kb.set_defaults(func=e.cmd_kernels_bench)

    mb = sub.add_parser("memory-bench",
                        help="peak RSS of `generate` on a long prompt vs the KV it holds, per codec")
    mb.add_argument("--model", default="smollm2-135m")
    mb.add_argument("--tokens", type=int_in(16, BIG), default=8000,
                    help="prompt tokens (with 8 new ones, within the context)")
    mb.add_argument("--methods", default="bf16,fp8,int4:r=32,int2:r=32,mxfp4,nvfp4",
                    help="comma-separated specs")
    mb.add_argument("--chunks", default="512,0", help="comma-separated --prefill-chunk values (0 = one pass)")
    mb.add_argument("--out", default="docs/results/kernels")
    mb.set_defaults(func=e.cmd_memory_bench)

    me = sub.add_parser("methods", help="list registered methods")
    me.add_argument("--markdown", action="store_true",
                    help="print docs/methods.md (generated from the registry)")
    me.set_defaults(func=c.cmd_methods)
    sub.add_parser("models", help="list known models and whether they are installed").set_defaults(
        func=c.cmd_models)
    return p


def one_line(e: BaseException) -> str:
    """The first line of an error's message (allocation failures said as such)."""
    text = " ".join(next((ln for ln in str(e).splitlines() if ln.strip()), "").split()) or type(e).__name__
    oom = type(e).__name__ == "OutOfMemoryError"
    if isinstance(e, MemoryError) or "can't allocate memory" in text or oom:
        return f"out of memory ({text}): try a shorter input or fewer tokens"
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, MemoryError) as e:
        print(f"kvstrata: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
