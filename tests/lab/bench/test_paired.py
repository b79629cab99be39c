"""Paired differences with bootstrap intervals, and the frontier marking the report uses."""

import pytest

from kvstrata_lab.bench.paired import Delta, paired_delta
from kvstrata_lab.bench.results import mark_frontier


def test_identical_scores_differ_by_nothing():
    a = {("single", i): float(i % 2) for i in range(10)}
    d = paired_delta(a, dict(a))
    assert (d.mean, d.lo, d.hi, d.n) == (0, 0, 0, 10) and d.verdict() == "not distinguishable"


def test_always_better_is_ahead_with_a_tight_interval():
    a = {("single", i): 1.0 for i in range(6)}
    b = {("single", i): 0.0 for i in range(8)}  # only the 6 shared instances are paired
    d = paired_delta(a, b)
    assert (d.mean, d.lo, d.hi, d.n) == (1, 1, 1, 6) and d.verdict() == "ahead"
    assert paired_delta(b, a).verdict() == "behind"
    assert paired_delta(a, {("multikey", 0): 1.0}) is None


def test_tasks_weigh_equally_and_the_interval_covers_the_mean():
    # task x: 2 instances, both +1; task y: 10 instances, half -1 -> mean over tasks (1 + -0.5) / 2
    a = {("x", 0): 1.0, ("x", 1): 1.0, **{("y", i): float(i % 2) for i in range(10)}}
    b = {("x", 0): 0.0, ("x", 1): 0.0, **{("y", i): 1.0 for i in range(10)}}
    d = paired_delta(a, b)
    assert d.mean == pytest.approx(0.25) and d.n == 12
    assert d.lo < d.mean < d.hi and d.lo >= -0.5 and d.hi <= 1
    assert d.text() == f"+25 [{round(d.lo * 100):+d}, {round(d.hi * 100):+d}] (n=12)"
    assert Delta(-1e-17, -0.004, 0.6, 3).text() == "+0 [+0, +60] (n=3)"  # float noise never prints -0
    assert paired_delta(a, b) == d  # a fixed seed: the same interval every time


def test_frontier_marks_only_undominated_points():
    pts = [{"m": "a", "bytes": 10, "q": 0.9}, {"m": "b", "bytes": 5, "q": 0.9},
           {"m": "c", "bytes": 4, "q": 0.5},
           {"m": "d", "bytes": 6, "q": 0.7}, {"m": "e", "bytes": 3, "q": None}]
    mark_frontier(pts, "bytes", "q")
    assert [p["m"] for p in pts if p["frontier"]] == ["b", "c"]


def test_frontier_treats_costs_a_rounding_apart_as_equal():
    pts = [{"bytes": 6480.0, "q": 0.8}, {"bytes": 6479.6, "q": 0.7}]
    mark_frontier(pts, "bytes", "q")
    assert [p["frontier"] for p in pts] == [True, False]
