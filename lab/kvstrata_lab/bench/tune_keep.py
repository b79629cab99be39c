"""`kvstrata tune --keep POLICY --bytes B`: trade tokens for bits at a fixed size.

Below four bits per value a cache can either code every token more coarsely or keep fewer tokens at
a better code. At a bytes target both meet, so the question is which mix loses least. For every
rung of the ladder this search pairs the rung with the largest keep fraction (two digits) at which
the keep policy over it stores at most `B` bytes per token, measures each pair on the calibration
instances, keeps the pair with the best calibration quality (budget met first, then retrieval,
top-1 and KL), and certifies it on held-out instances like the per-layer search does. With
`layer_keep="mass"` the keep fraction is a mean over layers, split by attention mass
(`kvstrata_lab.bench.layer_keep`).
"""

from __future__ import annotations

import math

from tqdm import tqdm

from kvstrata.methods import parse_method
from kvstrata_lab.bench.layer_keep import allocate, mass_curves, policy_scores, render_keep
from kvstrata_lab.bench.tune import Evaluator, TuneConfig, certify, check_config, passes, quality


def check_keep(cfg: TuneConfig, policy: str) -> None:
    """Refuse what this search cannot do before anything loads."""
    if cfg.bytes is None:
        raise ValueError("--keep trades tokens for bits at a size: give --bytes")
    if cfg.kv_apart:
        raise ValueError("--keep searches whole-model recipes; it does not take --kv-apart")
    why = ""
    try:
        kept = parse_method(f"{policy}:keep=0.5").full.keep
    except ValueError as e:
        kept, why = None, f" ({e})"
    if kept is None:
        raise ValueError(f"--keep {policy!r} is not a keep policy with a keep= fraction" + why)
    if cfg.layer_keep == "mass" and not kept.needs_scores:
        raise ValueError(f"--layer-keep mass splits by attention scores; {policy!r} keeps without them")
    for rung in cfg.ladder:
        if parse_method(rung).full.keep is not None:
            raise ValueError(f"ladder rung {rung!r} has its own keep policy; with --keep a rung is a codec")
    check_config(cfg)


def compose(policy: str, keep: float, rung: str, curves: list | None = None) -> str:
    """The method spec of `policy` keeping `keep` of the tokens over `rung` (`rung` alone at 1); with
    lost-mass `curves`, `keep` is the mean over layers of fractions split by them."""
    if keep >= 1:
        return rung
    return render_keep(policy, allocate(curves, keep) if curves is not None else [keep], rung)


def keep_curves(ev: Evaluator, cfg: TuneConfig, policy: str) -> list | None:
    """With `layer_keep="mass"`: per layer, the attention mass `policy` loses at each kept fraction,
    averaged over the calibration prompts (kept in the state file); None otherwise."""
    if cfg.layer_keep != "mass":
        return None
    window = parse_method(f"{policy}:keep=0.5").full.keep.window

    def measure() -> list:
        cells = [(t, i) for t in (*cfg.tasks, "fidelity") for i in cfg.calib]
        prompts = [[policy_scores(s, window) for s in ev.prefill(t, i)[1].scores]
                   for t, i in tqdm(cells, desc="tune: attention mass per layer", unit="prompt")]
        return mass_curves(prompts)

    return ev.memo(f"curves/{policy}/{','.join(cfg.tasks)}/{','.join(map(str, cfg.calib))}", measure)


def fit_keep(ev: Evaluator, cfg: TuneConfig, policy: str, rung: str,
             curves: list | None = None) -> str | None:
    """The spec with the largest keep fraction (hundredths) over `rung` whose bytes per token, as the
    certificate counts them, are within the target on every calibration question (they vary with a
    context's token count: partial groups, sinks); None when even 1 % of tokens is over."""
    questions = [(t, i) for t in cfg.tasks for i in cfg.calib]

    def size(spec: str, cells) -> float:
        return max(ev.run(t, i, [spec])[spec]["bytes_per_token"] for t, i in cells)

    keep = min(1.0, math.floor(100 * cfg.bytes / size(rung, questions[:1])) / 100)
    while keep >= 0.01:
        spec = compose(policy, keep, rung, curves)
        if size(spec, questions) <= cfg.bytes:
            return spec
        keep = round(keep - 0.01, 2)
    return None


def rank(q: dict, cfg: TuneConfig) -> tuple:
    """Better calibration quality sorts higher: the budget met, then retrieval, top-1, lower KL."""
    return passes(q, cfg), q["retrieval"] if q["retrieval"] is not None else 0.0, q["top1"], -q["kl"]


def tune_keep(cfg: TuneConfig, policy: str, load_model=None) -> dict:
    """Search the rung x keep pairs at `cfg.bytes`, certify the best on held-out instances, write
    `OUT/certificate.json`; returns the certificate."""
    check_keep(cfg, policy)
    ev = Evaluator(cfg, load_model)
    curves = keep_curves(ev, cfg, policy)
    fitting = tqdm(cfg.ladder, desc="tune: keep fraction per rung", unit="rung")
    specs = [s for s in (fit_keep(ev, cfg, policy, r, curves) for r in fitting) if s is not None]
    if not specs:
        raise ValueError(f"no rung fits {cfg.bytes:g} bytes per token even keeping 1 % of tokens")
    bar = tqdm(specs, desc="tune: keep x codec", unit="candidate")
    tried = {s: quality(ev, cfg, s, cfg.calib) for s in bar}
    chosen = max(specs, key=lambda s: rank(tried[s], cfg))
    held = quality(ev, cfg, chosen, cfg.heldout, keep=False, desc="tune: held-out certificate")
    return certify(cfg, tried[chosen], held, list(tried.values()), keep=policy, layer_keep=cfg.layer_keep,
                   **({"lost_mass_curves": curves} if curves is not None else {}))
