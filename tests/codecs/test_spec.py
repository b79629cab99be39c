"""`kvstrata.codecs.spec`: spec text parsed into config objects and rendered back from them."""

import pytest

from kvstrata.codecs import FP8, INT2, build, get_codec, spec_of, split_spec
from kvstrata.keep import SnapKV
from kvstrata.read import TopK


def test_split_spec():
    assert split_spec(" INT2:group=32, r=128 ") == ("int2", {"group": "32", "r": "128"})
    assert split_spec("bf16") == ("bf16", {})
    with pytest.raises(ValueError, match="given twice"):
        split_spec("fp8:block=1,block=2")
    with pytest.raises(ValueError, match="key=value"):
        split_spec("fp8:block")


@pytest.mark.parametrize(
    "obj, text",
    [
        (FP8(), "fp8"),
        (FP8(block=32), "fp8:block=32"),
        (INT2(group=64), "int2:group=64"),
        (SnapKV(keep=0.3), "snapkv:keep=0.3"),
        (TopK(k=64, hier=True), "topk:k=64,hier=1"),
    ],
)
def test_spec_of_renders_only_what_differs_and_parses_back(obj, text):
    assert spec_of(obj) == text
    stratum = {"fp8": "store", "int2": "store", "snapkv": "keep", "topk": "read"}[obj.name]
    assert build(text, stratum) == obj


def test_bad_parameters_name_what_is_wrong():
    with pytest.raises(ValueError, match="codec fp8: unknown parameter 'q'"):
        get_codec("fp8:q=1")
    with pytest.raises(ValueError, match="parameter block='x' is not a valid int"):
        get_codec("fp8:block=x")
    with pytest.raises(ValueError, match="unknown codec 'fp5'"):
        get_codec("fp5")
