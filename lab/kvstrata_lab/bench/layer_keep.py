"""Per-layer keep fractions for `kvstrata tune --keep POLICY --layer-keep mass`.

One keep fraction for every layer evicts much of what a layer attends to where its attention is
spread out and almost nothing where it sits on a few tokens (PyramidKV and CAKE give layers unequal
budgets for this reason). Here the split is measured: on the calibration prompts, each
full-attention layer's policy scores (e.g. TOVA's last query, averaged over heads) give the share of
attention mass a layer loses at each kept fraction; every layer then keeps the fraction at which it
loses the same share, the shared loss set so that the layers' mean fraction meets the bytes. The
fractions are fixed before any reported instance is seen (calibration prompts only).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

import torch

from kvstrata_lab.bench.tune import REFERENCE, with_overrides

STEPS = 100  # fractions in hundredths


def lost_mass(scores: torch.Tensor) -> list[float]:
    """`scores: [n]` (>= 0) -> the share of their sum lost when keeping the top 1 %, 2 %, ... 100 %
    (rounded as the keep policies round: at least one token)."""
    s = scores.float().clamp_min(0).sort(descending=True).values
    kept = s.cumsum(0) / s.sum().clamp_min(1e-30)
    n = s.numel()
    at = [min(n, max(1, round(j * n / STEPS))) for j in range(1, STEPS + 1)]
    return [0.0 if k == n else max(0.0, 1.0 - float(kept[k - 1])) for k in at]


def policy_scores(window_rows: torch.Tensor | None, window: int) -> torch.Tensor | None:
    """A prefill layer's observation-window rows `[1, kv_heads, w, n]` -> the policy's scores `[n]`:
    its last `window` rows summed, averaged over KV heads (None for layers without scores). TOVA's
    own scores; for SnapKV an approximation (no pooling, its observation window not set apart)."""
    if window_rows is None:
        return None
    return window_rows[0, :, -window:, :].float().sum(1).mean(0)


def mass_curves(prompts: list[list[torch.Tensor | None]]) -> list[list[float] | None]:
    """Per layer, the lost-mass curve averaged over prompts (each prompt: per-layer scores `[n]`)."""
    curves: list[list[float] | None] = []
    for layer in zip(*prompts):
        if any(s is None for s in layer):
            curves.append(None)
            continue
        rows = [lost_mass(s) for s in layer]
        curves.append([sum(col) / len(rows) for col in zip(*rows)])
    return curves


def _fraction(curve: list[float], loss: float) -> int:
    """Hundredths kept: the fewest whose lost mass is at most `loss`."""
    return next(j for j, lost in enumerate(curve, 1) if lost <= loss + 1e-12)


def allocate(curves: list[list[float] | None], mean_keep: float) -> list[float | None]:
    """Per layer the kept fraction (hundredths; None where a layer has no scores) that loses one
    shared share of attention mass, the smallest share whose mean fraction is at most `mean_keep`."""
    scored = [c for c in curves if c is not None]
    if not scored:
        raise ValueError("no layer has attention scores to split a keep budget by")
    losses = sorted({x for c in scored for x in c} | {0.0})

    def mean_at(loss: float) -> float:
        return sum(_fraction(c, loss) for c in scored) / (STEPS * len(scored))

    # mean_at falls as the shared loss grows: the first loss in the sorted list that fits
    lo = bisect_left(range(len(losses)), True, key=lambda k: mean_at(losses[k]) <= mean_keep + 1e-9)
    loss = losses[min(lo, len(losses) - 1)]
    return [None if c is None else _fraction(c, loss) / STEPS for c in curves]


def render_keep(policy: str, fractions: list[float | None], rung: str) -> str:
    """The method spec: the most common fraction for every layer, `layers[...]=` for the others (a
    layer keeping everything gets the rung alone; layers without scores, where the policy does not
    apply, take the common recipe)."""

    def recipe(f: float) -> str:
        if f >= 1:
            return rung
        head = f"{policy}:keep={f:.2f}"
        return head if rung == REFERENCE else f"{head}+{rung}"

    scored = {i: recipe(f) for i, f in enumerate(fractions) if f is not None}
    counts = Counter(scored.values())
    order = list(counts)  # first use first: ties go to the lower layers
    return with_overrides(max(order, key=counts.__getitem__), scored, order)
