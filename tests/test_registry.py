"""`kvstrata.registry`: one entry per method name, with its stratum, defaults and tolerance."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

import kvstrata.methods  # noqa: F401 - the spec grammar imports every stratum: the registry is full
from kvstrata.codecs import INT4, NVFP4, build, get_codec
from kvstrata.registry import KIVI, REGISTRY, STRATA, Tolerance, classes, entries, register, unregister


def test_every_stratum_is_filled_and_every_store_codec_has_a_tolerance():
    assert all(entries(s) for s in STRATA)
    assert all(isinstance(e.tolerance, Tolerance) for e in entries("store"))
    assert REGISTRY["int4"].defaults == KIVI and REGISTRY["nvfp4"].defaults["r"] == 0
    assert classes("store")["nvfp4"] is NVFP4 and REGISTRY["topk"].stratum == "read"


def test_a_name_cannot_be_taken_twice_and_a_store_codec_needs_a_tolerance():
    @dataclass(frozen=True)
    class Clash:
        name: ClassVar[str] = "int4"
        summary: ClassVar[str] = "another int4"

    with pytest.raises(ValueError, match="already registered by INT4"):
        register(Clash, "store", tolerance=Tolerance(0.1, 0.1))
    register(INT4, "store", defaults=KIVI, tolerance=REGISTRY["int4"].tolerance)  # the same class again: fine

    @dataclass(frozen=True)
    class Loose:
        name: ClassVar[str] = "loose"
        summary: ClassVar[str] = "no tolerance"

    with pytest.raises(ValueError, match="needs a Tolerance"):
        register(Loose, "store")
    with pytest.raises(ValueError, match="stratum must be one of"):
        register(Loose, "place")


def test_specs_built_before_a_change_are_not_served_after_it():
    @dataclass(frozen=True)
    class Policy:
        keep: float = 0.5
        name: ClassVar[str] = "halfkeep"
        summary: ClassVar[str] = "a test keep policy"

    with pytest.raises(ValueError, match="unknown method 'halfkeep'"):
        build("halfkeep", "keep")
    register(Policy, "keep")
    try:
        assert build("halfkeep:keep=0.25", "keep") == Policy(0.25)
    finally:
        unregister("halfkeep")
    with pytest.raises(ValueError, match="unknown method 'halfkeep'"):
        build("halfkeep", "keep")
    assert get_codec("nvfp4") is get_codec("nvfp4")  # immutable configs are shared
