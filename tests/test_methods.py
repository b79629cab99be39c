import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstrata.codecs import Rotation, build, spec_of
from kvstrata.methods import METHODS, knob_table, parse_method, render


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
        ("nvfp4:r=-1", r"r must be an integer in \[0, 16777216\]"),
        ("nvfp4:r=x", "r must be an integer"),
        ("nvfp4:q=1", "unknown parameter 'q'"),
        ("nvfp4:r", "key=value"),
        ("nvfp4:r=1,r=2", "given twice"),
        ("nvfp4;global=fp8", "class"),
        ("nvfp4+", "empty component"),
        ("nvfp4+fp8", "at most one"),
        ("fp8:keys=channel", "grouped integer"),
        ("int4:keys=diagonal", "keys must be one of token, channel, got 'diagonal'"),
        ("layers[0-3]=fp8;layers[3]=bf16", "layer 3 is assigned twice"),
        ("layers[a]=fp8", "'a' is not a layer index"),
        ("layers[3-1]=fp8", "empty"),
        ("layers[0]=fp8+topk:k=64", "whole model"),
        ("layers[0]=fp8;nvfp4", "goes first"),
        ("depth;layers[0]=fp8", "does not combine"),
        ("nvfp4:smooth=2", r"smooth must be a number in \[0, 1\]"),
        ("nvfp4:smooth=x", "smooth must be"),
        ("nvfp4:outliers=-1", r"outliers must be an integer in \[0, 256\]"),
        ("nvfp4:outliers=x", "outliers must be"),
        ("int4:outliers=2", "outliers=2 does not combine with keys=channel: .*outliers needs keys=token"),
        ("nvfp4:ofmt=fp8", "ofmt=fp8 needs outliers"),
        ("nvfp4:outliers=2,ofmt=int8", "ofmt must be one of bf16, fp8, got 'int8'"),
        ("nvfp4:sink=-1", r"sink must be an integer in \[0, 1024\]"),
        ("nvfp4:sink=2000", "sink must be an integer"),
        ("nvfp4:center=2", "center must be 0 or 1, got '2'"),
        ("depth:g=2+nvfp4:center=1", "center=1 does not combine with depth sharing"),
        ("depth:g=2+nvfp4:sink=4", "sink=4 does not combine with depth sharing"),
        ("depth:g=2+nvfp4:v=fp8", "v=fp8 does not combine with depth sharing"),
        ("nvfp4:rotseed=3", "rotseed=3 needs rot"),
        ("nvfp4:v=snapkv", "v must name a store codec"),
        ("nvfp4:v=fp5", "v must name a store codec"),
        ("int4:vgroup=64", "vgroup=64 needs v"),
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
    assert m.recipe("full", 2).transform(Rotation) == Rotation("hadamard") and m.max_layer() == 3
    # layers[...] wins over the class override, which wins over the bare recipe
    m = parse_method("nvfp4;sliding=fp8;layers[0]=bf16")
    assert [spec_of(m.recipe(c, i).codec) for c, i in (("sliding", 0), ("sliding", 1), ("full", 1))] == [
        "bf16", "fp8", "nvfp4"]
    assert parse_method("fp8").max_layer() == -1


# --- rendering: every parsed spec renders back to text that parses equal ---------------------------
ROOT = Path(__file__).resolve().parents[1]
NOT_SPECS = ("dynamic", "static", "kvpress:", "qcache:", "llamacpp:")  # stock rows and peers: not specs


def committed_specs() -> set[str]:
    """Every method spec the committed results name: rows, certificates, tuner states."""
    found = set()
    for path in (ROOT / "docs" / "results").rglob("*.jsonl"):
        rows = path.read_text().splitlines()
        found |= {json.loads(line).get("method", "") for line in rows if line.strip()}
    for path in (ROOT / "docs" / "results").rglob("certificate.json"):
        cert = json.loads(path.read_text())
        found |= {cert["spec"]} | {s["spec"] for s in cert.get("search", [])}
    for path in (ROOT / "docs" / "results").rglob("tune_state.json"):
        found |= {key.split("/", 2)[2] for key in json.loads(path.read_text())["results"]}
    return {s for s in found if s and not s.startswith(NOT_SPECS)}


def _round_trips(spec) -> None:
    text = render(spec)
    again = parse_method(text)
    assert again == spec, f"{spec.text!r} renders as {text!r}, which parses to something else"
    assert render(again) == text


def test_committed_specs_render_back_to_what_they_parse_to():
    specs = committed_specs()
    assert len(specs) > 100  # the committed results are there
    for text in specs:
        _round_trips(parse_method(text))


def test_the_methods_page_examples_render_back():
    from kvstrata.cli.methods_doc import markdown

    examples = [s for s in re.findall(r"`([^`\n]+)`", markdown())]
    parsed = []
    for text in examples:
        try:
            parsed.append(parse_method(text))
        except ValueError:  # a code span that is not a spec (`r=64`, a module name)
            continue
    assert len(parsed) >= 20
    for spec in parsed:
        _round_trips(spec)


VALUES = ["0", "1", "2", "3", "4", "8", "16", "32", "64", "128", "0.5", "1.0", "none", "hadamard", "bf16",
          "fp8", "nvfp4", "int4", "int2", "token", "channel", "minmax", "lsq"]
POOLS = {"r": ["0", "8", "32", "128"], "keys": ["token", "channel"], "rot": ["none", "hadamard"],
         "rotseed": ["0", "3"], "smooth": ["0", "0.5", "1.0"], "center": ["0", "1"], "sink": ["0", "2", "4"],
         "outliers": ["0", "2", "4"], "ofmt": ["bf16", "fp8"], "v": ["bf16", "fp8", "nvfp4", "int4", "int2"],
         "vgroup": ["16", "32", "64"], "fit": ["minmax", "lsq"], "group": ["16", "32", "64"],
         "block": ["0", "32"], "tensor_scale": ["0", "1"]}  # a knob not listed here draws from VALUES
STORE_KEYS = sorted({k.key for k, _ in knob_table()} | {"group", "block", "tensor_scale"})


@st.composite
def recipes(draw, whole_model: bool = True) -> str:
    codec = draw(st.sampled_from([n for n, e in METHODS.items() if e.stratum == "store"]))
    keys = draw(st.lists(st.sampled_from(STORE_KEYS), max_size=5, unique=True))
    params = [f"{k}={draw(st.sampled_from(POOLS.get(k, VALUES)))}" for k in keys]
    comps = [codec + (":" + ",".join(params) if params else "")]
    comps += draw(st.lists(st.sampled_from(["streaming:keep=0.5", "tova:keep=0.3", "snapkv:keep=0.25"]),
                           max_size=1))
    if whole_model:
        comps += draw(st.lists(st.sampled_from(["depth:g=2", "minicache", "depth:g=3,mode=exact"]),
                               max_size=1))
        comps += draw(st.lists(st.sampled_from(["topk:k=64", "topk:k=32,indexer=lowrank"]), max_size=1))
    return "+".join(draw(st.permutations(comps)))


@st.composite
def specs(draw) -> str:
    text = draw(recipes())
    if draw(st.booleans()):
        text += ";sliding=" + draw(recipes())
    if draw(st.booleans()):
        text += f";layers[{draw(st.sampled_from(['0', '1-3', '0,2', '5-9,12']))}]=" + draw(recipes(False))
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(specs())
def test_any_spec_the_grammar_takes_renders_back_equal(text):
    try:
        spec = parse_method(text)
    except ValueError:
        assume(False)
    _round_trips(spec)
