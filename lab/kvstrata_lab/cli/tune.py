"""`kvstrata tune`: the cheapest per-layer assignment that keeps a quality budget, certified on
held-out instances; its flags' defaults are `TuneConfig`'s."""

from __future__ import annotations

import sys
from pathlib import Path

from kvstrata.cli.inputs import BIG, SEED, field_default, float_in, int_in
from kvstrata.knobs import ranges_text
from kvstrata_lab.bench.config import TuneConfig


def register(sub) -> None:
    def default(name: str):
        return field_default(TuneConfig, name)

    tu = sub.add_parser("tune", help="the cheapest per-layer assignment that keeps a quality budget, "
                        "certified on held-out instances (resumable)")
    tu.add_argument("--model", required=True)
    tu.add_argument("--length", type=int_in(64, BIG), required=True, help="context length in tokens")
    tu.add_argument("--ladder",
                    help=f"comma-separated recipes, best first (default {','.join(default('ladder'))})")
    tu.add_argument("--tasks", help=f"comma-separated retrieval tasks (default {','.join(default('tasks'))}; "
                    "calib: the calibration text families; report is refused: claims are measured on it)")
    tu.add_argument("--calib", default=ranges_text(default("calib")),
                    help="calibration instance indices, e.g. 100-103 (default %(default)s; the benchmark "
                         "reports 0-19)")
    tu.add_argument("--heldout", default=ranges_text(default("heldout")),
                    help="held-out instance indices for the certificate (default %(default)s)")
    tu.add_argument("--max-drop", type=float_in(0, 1), default=default("max_drop"),
                    help="retrieval (0-1) the spec may lose against bf16 on the same instances")
    tu.add_argument("--top1", type=float_in(0, 1), default=default("top1"), help="floor on top-1 agreement")
    tu.add_argument("--bytes", type=float_in(1, 1e9), help="target stored bytes per token (checked)")
    tu.add_argument("--seed", type=SEED, default=default("seed"))
    tu.add_argument("--haystack", default=default("haystack"), choices=("noise", "natural"))
    tu.add_argument("--kv-apart", action="store_true",
                    help="give each layer's keys and values rungs of their own (twice the sensitivity runs)")
    tu.add_argument("--keep", metavar="POLICY",
                    help="trade tokens for bits at --bytes: each rung with the largest keep fraction of "
                    "POLICY (e.g. tova) that fits, the best on calibration certified")
    tu.add_argument("--layer-keep", choices=("uniform", "mass"), default=default("layer_keep"),
                    help="with --keep: one fraction for every layer, or fractions that lose each layer "
                    "the same share of attention mass on the calibration prompts (mean fitted to --bytes)")
    tu.add_argument("--out", default=str(default("out")))
    tu.set_defaults(func=run)


def run(args) -> int:
    from kvstrata.cli.inputs import check_context, csv_items, split_methods, writable_dir
    from kvstrata.knobs import parse_ranges
    from kvstrata.models import check_method
    from kvstrata_lab.bench.tune import check_plain, tune
    from kvstrata_lab.bench.tune_keep import check_keep, tune_keep

    cfg = TuneConfig(
        model=args.model, length=args.length,
        ladder=tuple(split_methods(args.ladder)) if args.ladder else field_default(TuneConfig, "ladder"),
        tasks=csv_items(args.tasks) if args.tasks else field_default(TuneConfig, "tasks"),
        calib=parse_ranges(args.calib, "--calib", "an instance index", 10**6),
        heldout=parse_ranges(args.heldout, "--heldout", "an instance index", 10**6),
        max_drop=args.max_drop, top1=args.top1, bytes=args.bytes, seed=args.seed, haystack=args.haystack,
        kv_apart=args.kv_apart, layer_keep=args.layer_keep, out=Path(args.out),
    )
    if args.keep:  # before any model loads
        check_keep(cfg, args.keep)
    else:
        check_plain(cfg)
    for rung in cfg.ladder:
        check_method(args.model, rung)  # a rung the model's shape cannot take
    check_context(args.model, args.length, "--length")
    writable_dir(cfg.out, "--out")  # as bench: refused now, not after minutes of sensitivity runs
    cert = tune_keep(cfg, args.keep) if args.keep else tune(cfg)
    held = cert["heldout"]
    delta = held["delta_vs_bf16"]
    print(f"spec: {cert['spec']}")
    ci = "" if not delta else (f" (Δ {delta['mean']:+.2f}, 95 % CI [{delta['ci95'][0]:+.2f}, "
                               f"{delta['ci95'][1]:+.2f}])")
    print(f"held-out ({len(held['indices'])} per task, {held['n_questions']} questions): "
          f"{held['compression']:.2f}× smaller, retrieval {_num(held['retrieval'])} vs bf16 "
          f"{_num(held['bf16_retrieval'])}{ci}, top-1 {held['top1']:.3f}")
    if worst := held.get("worst_family"):
        lo, hi = worst["ci95"]
        print(f"worst family held out: {worst['family']} Δ {worst['mean']:+.2f}, "
              f"95 % CI [{lo:+.2f}, {hi:+.2f}] (n={worst['n']})")
    print(f"certificate: {cfg.out / 'certificate.json'}")
    met = cert["quality_met_on_calibration"] and cert["heldout_quality_met"]
    met = met and cert["bytes_met"] is not False
    if not met:
        print("budget not met (see the certificate's calibration / heldout / bytes_met)", file=sys.stderr)
    return 0 if met else 1


def _num(x) -> str:
    return "–" if x is None else f"{x:.2f}"
