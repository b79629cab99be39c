"""Comparing greedy answers: equal, or apart only from a near-tie on.

A greedy choice whose lead over the runner-up is below `NEAR_TIE` (in logits) is a near-tie: where
the same cache contents summed in another order (rows computed in a batch, runs joined or split, a
replay's window fitted on other tokens) may move a lossy code across a quantization step, and so
the choice. The tiny models' median lead is 0.04-0.09; SmolLM2's bf16 logits move in steps of
0.06-0.125 near the top, so there only exact ties count.
"""

NEAR_TIE = 0.02
# a replay recomputes the sliding windows reading the full layers' codes where the cold prefill read
# its own chunk in full precision: with a lossy codec an approximation (docs/store.md), whose answers
# part from the cold run's only at choices led by less than this (measured: 0.022 at most here)
REPLAY_NEAR_TIE = 0.05


def apart_at(got: list[int], want: list[int]) -> int | None:
    """The first step where two greedy answers differ (None: equal)."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def agree_but_near_ties(got: list[int], want: list[int], leads: list[float], near: float = NEAR_TIE) -> bool:
    """`got` equals `want`, or differs first where `want`'s choice (leads: per step, the chosen
    logit's lead) was a near-tie (led by less than `near`)."""
    i = apart_at(got, want)
    return i is None or (i < len(leads) and leads[i] < near)
