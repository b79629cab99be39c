import pytest

from kvstrata.codecs import build, spec_of
from kvstrata.methods import parse_method


def test_defaults_and_params():
    m = parse_method("nvfp4:r=64")
    assert spec_of(m.full.codec) == "nvfp4" and m.full.r == 64 and m.full == m.sliding
    k = parse_method("int2:group=32,r=128")
    assert (spec_of(k.full.codec), k.full.r, k.full.key_axis) == ("int2", 128, "channel")
    assert parse_method("int4").full.r == 128  # KIVI default residual
    assert spec_of(parse_method("fp8:block=32").full.codec) == "fp8:block=32"


def test_values_take_their_own_codec():
    m = parse_method("int2:r=32,v=nvfp4")
    assert spec_of(m.full.codec) == "int2" and spec_of(m.full.value_codec) == "nvfp4" and m.full.r == 32
    assert m.full.key_axis == "channel"  # KIVI's keys; values per token in NVFP4
    plain = parse_method("nvfp4").full
    assert plain.vcodec is None and plain.value_codec is plain.codec


def test_layer_class_overrides():
    m = parse_method("nvfp4;sliding=fp8")
    assert spec_of(m.full.codec) == "nvfp4" and spec_of(m.sliding.codec) == "fp8"
    m = parse_method("bf16; full=mxfp4:r=16")
    assert spec_of(m.full.codec) == "mxfp4" and m.full.r == 16 and spec_of(m.sliding.codec) == "bf16"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("fp5", "unknown method 'fp5'"),
        ("nvfp4:r=-1", "r must be >= 0"),
        ("nvfp4:r=x", "not an integer"),
        ("nvfp4:q=1", "unknown parameter 'q'"),
        ("nvfp4:r", "key=value"),
        ("nvfp4:r=1,r=2", "given twice"),
        ("nvfp4;global=fp8", "class"),
        ("nvfp4+", "empty component"),
        ("nvfp4+fp8", "at most one"),
        ("fp8:keys=channel", "grouped integer"),
        ("int4:keys=diagonal", "'token' or 'channel'"),
        ("layers[0-3]=fp8;layers[3]=bf16", "layer 3 is assigned twice"),
        ("layers[a]=fp8", "'a' is not a layer index"),
        ("layers[3-1]=fp8", "empty"),
        ("layers[0]=fp8+topk:k=64", "whole model"),
        ("layers[0]=fp8;nvfp4", "goes first"),
        ("depth;layers[0]=fp8", "does not combine"),
        ("nvfp4:smooth=2", r"smooth must be a number in \[0, 1\]"),
        ("nvfp4:smooth=x", "smooth must be"),
        ("nvfp4:smooth=0.5+topk:k=8", "does not combine"),
        ("nvfp4:outliers=-1", r"outliers must be an integer in \[0, 256\]"),
        ("nvfp4:outliers=x", "outliers must be"),
        ("int4:outliers=2", "outliers needs keys=token"),
        ("nvfp4:ofmt=fp8", "ofmt=fp8 needs outliers=c"),
        ("nvfp4:outliers=2,ofmt=int8", "ofmt must be one of bf16, fp8, got 'int8'"),
        ("nvfp4:outliers=2+topk:k=8", "outlier channels does not combine"),
        ("nvfp4:sink=-1", r"sink must be an integer in \[0, 1024\]"),
        ("nvfp4:sink=2000", "sink must be an integer"),
        ("nvfp4:center=2", "center must be 0 or 1, got '2'"),
        ("nvfp4:sink=4+topk:k=8", r"a sink \(sink=\) does not combine"),
        ("depth:g=2+nvfp4:center=1", "key centering does not combine"),
        ("nvfp4:v=snapkv", "v must name a store codec"),
        ("nvfp4:v=fp5", "v must name a store codec"),
        ("nvfp4:v=fp8+topk:k=8", "values codec .* does not combine"),
        ("int4:vgroup=64", r"vgroup needs v=<codec>"),
        ("int4:v=nvfp4,vgroup=64", r"vgroup needs a grouped values codec \(int4, int3, int2\), got v=nvfp4"),
        ("int4:v=int4,vgroup=3", "group must be a positive multiple of 2"),
        ("int4:v=int4,vgroup=x", "group='x' is not a valid int"),
        ("fp8:fit=lsq", "fit applies to int4, int3, int2 and nvfp4 codes"),
        ("int4:fit=mse", "fit must be one of minmax, lsq, got 'mse'"),
    ],
)
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_fit_reaches_every_code_of_a_recipe_that_has_one():
    """`fit=` is one knob per recipe: every codec of it that has a fit gets it (FP8 has none)."""
    both = parse_method("int4:keys=channel,group=96,r=0,v=int4,vgroup=64,fit=lsq").full
    assert (both.codec.group, both.codec.fit) == (96, "lsq")
    assert (both.value_codec.group, both.value_codec.fit) == (64, "lsq")
    values = parse_method("nvfp4:v=int2,vgroup=16,fit=lsq").full.value_codec
    assert values == build("int2:group=16,fit=lsq", "store")
    both = parse_method("int4:fit=lsq,v=nvfp4").full
    assert both.codec.fit == "lsq" and spec_of(both.value_codec) == "nvfp4:fit=lsq"
    keys_only = parse_method("int4:fit=lsq,v=fp8").full
    assert keys_only.codec.fit == "lsq" and spec_of(keys_only.value_codec) == "fp8"
    assert parse_method("int4:v=int4").full.value_codec.fit == "minmax"


def test_per_layer_assignments():
    m = parse_method("layers[0-1,3]=fp8;layers[2]=int2:rot=hadamard")
    assert [spec_of(m.recipe("full", i).codec) for i in range(5)] == ["fp8", "fp8", "int2", "fp8", "bf16"]
    assert m.recipe("full", 2).rot == "hadamard" and m.max_layer() == 3
    # layers[...] wins over the class override, which wins over the bare recipe
    m = parse_method("nvfp4;sliding=fp8;layers[0]=bf16")
    assert [spec_of(m.recipe(c, i).codec) for c, i in (("sliding", 0), ("sliding", 1), ("full", 1))] == [
        "bf16", "fp8", "nvfp4"]
    assert parse_method("fp8").max_layer() == -1
