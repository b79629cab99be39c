"""`kvstrata retrofit`: a model as the source design's causal encoder-decoder (half-depth prefill,
the decoder's K/V projected from the middle), fitted on calibration text; `kvstrata retrofit-eval`:
its evidence beside the original. Flags default to `RetrofitConfig` / `EvalConfig`."""

from __future__ import annotations

from pathlib import Path

from kvstrata.cli.inputs import BIG, SEED, csv_items, field_default, float_in, int_in
from kvstrata.settings import DTYPES
from kvstrata_lab.bench.config import EvalConfig, RetrofitConfig


def register(sub) -> None:
    def default(name: str):
        return field_default(RetrofitConfig, name)

    rf = sub.add_parser(
        "retrofit",
        help="turn a model into a causal encoder-decoder (half-depth prefill): "
        "least-squares projections fitted on calibration text, saved as a model directory",
    )
    rf.add_argument("--model", required=True)
    rf.add_argument(
        "--out", required=True, help="directory to write (kvstrata's commands load it as a model)"
    )
    rf.add_argument("--split", type=int_in(1, 10_000), help="first decoder layer (default: half the depth)")
    rf.add_argument(
        "--n-win",
        type=int_in(1, BIG),
        default=default("n_win"),
        help="positions the decoder runs over and holds its own K/V for (default %(default)s)",
    )
    rf.add_argument(
        "--length", type=int_in(16, BIG), default=default("length"), help="tokens per calibration text"
    )
    rf.add_argument(
        "--texts", type=int_in(1, 10_000), default=default("texts"), help="calibration texts fitted on"
    )
    rf.add_argument(
        "--heldout",
        type=int_in(1, 1000),
        default=default("heldout"),
        help="calibration texts the errors are measured on",
    )
    rf.add_argument(
        "--ridge",
        type=float_in(0, 1),
        default=default("ridge"),
        help="least-squares ridge, times the normal equations' mean diagonal (default %(default)s)",
    )
    rf.add_argument(
        "--distill-minutes",
        type=float_in(0, 24 * 60),
        default=default("distill_minutes"),
        help="then distil the projections against the original's logits for this long (0: the "
        "least-squares fit alone; default %(default)s)",
    )
    rf.add_argument(
        "--lr", type=float_in(1e-7, 1), default=default("lr"), help="the distillation's Adam step"
    )
    rf.add_argument(
        "--dtype", choices=DTYPES, default=default("dtype"), help="the model's weights while fitting"
    )
    rf.add_argument("--seed", type=SEED, default=default("seed"))
    rf.add_argument(
        "--store-as",
        choices=("projected", "hidden"),
        default=default("store"),
        help="what the persistent store keeps of the decoder half: each decoder layer's projected K/V, "
        "or H(split) once per token with the projections applied on load (the decoder then runs on "
        "H(split) as the recipe's value codec holds it; default %(default)s)",
    )
    rf.set_defaults(func=run_fit)

    ev = sub.add_parser(
        "retrofit-eval",
        help="an encoder-decoder directory beside its original: K/V and "
        "attention errors, prefill time, answers on the report families (resumable)",
    )
    ev.add_argument("--model", required=True, help="the original model")
    ev.add_argument("--ced", required=True, help="its directory written by `kvstrata retrofit`")
    ev.add_argument("--out", required=True)
    ev.add_argument(
        "--length",
        type=int_in(64, BIG),
        default=field_default(EvalConfig, "length"),
        help="report instances' nominal length in tokens (default %(default)s)",
    )
    ev.add_argument(
        "--tasks",
        default=",".join(field_default(EvalConfig, "tasks")),
        help="report families to answer (report, report-reason)",
    )
    ev.add_argument(
        "--n", type=int_in(0, 100_000), default=field_default(EvalConfig, "n"), help="instances per task"
    )
    ev.add_argument(
        "--timing",
        type=lengths,
        default=field_default(EvalConfig, "timing"),
        help="comma-separated prefill lengths timed ('': none; default "
        f"{','.join(map(str, field_default(EvalConfig, 'timing')))})",
    )
    ev.add_argument(
        "--repeats",
        type=int_in(1, 100),
        default=field_default(EvalConfig, "repeats"),
        help="timed prefills per model and length, alternating; the median is kept (default %(default)s)",
    )
    ev.add_argument(
        "--dtype",
        choices=DTYPES,
        default=field_default(EvalConfig, "dtype"),
        help="both models' weights and activations",
    )
    ev.add_argument(
        "--store-method",
        default=field_default(EvalConfig, "store_method"),
        help="serve a prompt through the persistent store with the decoder half kept both ways (projected "
        "K/V, H(split)) at this method: bytes per token, hit vs cold ('': skip; default %(default)s)",
    )
    ev.set_defaults(func=run_eval)


def lengths(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated token counts (each >= 64)."""
    return tuple(int_in(64, BIG)(t) for t in csv_items(text))


def run_fit(args) -> int:
    from kvstrata.cli.inputs import model_name, writable_dir
    from kvstrata.models import load_config
    from kvstrata.models.ced.store import check_plan
    from kvstrata_lab.bench.retrofit import retrofit

    model_name(args.model)
    check_plan(load_config(args.model), args.split, args.n_win)
    out = writable_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()) and not (out / "ced.json").is_file():
        raise ValueError(f"--out {out}: exists and is not an encoder-decoder directory; name a new one")
    cfg = RetrofitConfig(
        model=args.model,
        out=out,
        split=args.split,
        n_win=args.n_win,
        length=args.length,
        texts=args.texts,
        heldout=args.heldout,
        ridge=args.ridge,
        distill_minutes=args.distill_minutes,
        lr=args.lr,
        dtype=args.dtype,
        seed=args.seed,
        store=args.store_as,
    )
    rep = retrofit(cfg)
    errs = ", ".join(f"{k:.2f}/{v:.2f}" for k, v in zip(rep["key_error"], rep["value_error"]))
    d = rep["distill"]
    distilled = (
        f", distilled {d['steps']} steps in {d['seconds']:.0f} s (KL {d['loss_first']:.3f} -> "
        f"{d['loss_last']:.3f} nats/row)"
        if d["steps"]
        else ""
    )
    print(
        f"{cfg.out}: split {rep['split']}, n_win {rep['n_win']}, fitted on {rep['tokens']:,} tokens in "
        f"{rep['fit_s']:.0f} s{distilled}; held-out relative error K/V per decoder layer: {errs}"
    )
    return 0


def run_eval(args) -> int:
    import json

    from kvstrata.cli.inputs import model_name, writable_dir
    from kvstrata_lab.bench.retrofit import evaluate
    from kvstrata_lab.bench.tasks import FAMILY_TASKS, REASON_TASKS

    model_name(args.model)
    if not (Path(args.ced) / "ced.safetensors").is_file():
        raise ValueError(f"--ced {args.ced}: no encoder-decoder directory (run `kvstrata retrofit` first)")
    tasks = tuple(csv_items(args.tasks))
    bad = [t for t in tasks if t not in FAMILY_TASKS + REASON_TASKS or not t.startswith("report")]
    if bad:
        raise ValueError(f"--tasks: {', '.join(bad)}: the evidence is measured on report families only")
    if args.store_method:
        from kvstrata.models.loader import check_method

        check_method(args.ced, args.store_method, store=True)  # before any weights load
    cfg = EvalConfig(
        model=args.model,
        ced=Path(args.ced),
        out=writable_dir(args.out, "--out"),
        length=args.length,
        tasks=tasks,
        n=args.n,
        timing=args.timing,
        repeats=args.repeats,
        dtype=args.dtype,
        store_method=args.store_method,
    )
    res = evaluate(cfg)
    print(
        json.dumps(
            {k: res[k] for k in ("attention_error", "prefill", "answers", "store") if k in res}, indent=1
        )
    )
    return 0
