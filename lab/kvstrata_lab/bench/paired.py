"""Paired comparisons with their uncertainty: method A against method B on the same instances.

With 20 questions per task one answer is five points, so "ahead", "equal" or "within 1 point" is
only said with a 95 % interval from a bootstrap over instances (resampled within each task, the
statistic being the mean over tasks of the mean per-instance difference, as retrieval is averaged).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

BOOTSTRAP = 2000
SEED = 0


@dataclass(frozen=True)
class Delta:
    """Mean paired difference (A - B), its 95 % bootstrap interval and the number of pairs."""

    mean: float
    lo: float
    hi: float
    n: int

    def text(self) -> str:
        """`+5 [-2, +12] (n=40)`: in points (score x 100)."""
        pts = lambda v: f"{round(v * 100):+d}"  # noqa: E731  (an int: float noise never prints as -0)
        return f"{pts(self.mean)} [{pts(self.lo)}, {pts(self.hi)}] (n={self.n})"

    def verdict(self, margin: float = 0.0) -> str:
        """'ahead' / 'behind' when the whole interval lies beyond `+margin` / `-margin`, else 'not
        distinguishable' (all the data can say)."""
        if self.lo > margin:
            return "ahead"
        if self.hi < -margin:
            return "behind"
        return "not distinguishable"


def paired_delta(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float],
                 n_boot: int = BOOTSTRAP, seed: int = SEED) -> Delta | None:
    """A - B over the (task, instance) keys both scored; None when they share none."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for key in sorted(a.keys() & b.keys()):
        by_task[key[0]].append(a[key] - b[key])
    if not by_task:
        return None
    rng = np.random.default_rng(seed)
    means, boots = [], []
    for task in sorted(by_task):
        d = np.asarray(by_task[task], dtype=float)
        means.append(d.mean())
        boots.append(d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1))
    stat = np.mean(boots, axis=0)
    lo, hi = np.percentile(stat, [2.5, 97.5])
    return Delta(float(np.mean(means)), float(lo), float(hi), sum(len(v) for v in by_task.values()))


def scores_by_instance(rows: list[dict], method: str, tasks) -> dict[tuple[str, int], float]:
    """{(task, index): score} of one method's scored rows on `tasks`."""
    return {
        (r["task"], r["index"]): r["score"]
        for r in rows
        if r["method"] == method and r["task"] in tasks and r.get("score") is not None
    }
