"""`kvstrata tune` on a tiny model: the budget holds for what it picks, calibration and held-out
instances stay apart, a rerun measures nothing again, and the path / spec helpers."""

import json

import pytest

from kvstrata.cli import main
from kvstrata.codecs import Rotation
from kvstrata.hf import CompressedCache
from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.tune import TuneConfig, check_config, kv_recipe, passes, render, tune, upgrade_path

LADDER = ("bf16", "fp8", "int2:r=4,group=8")


def _cfg(out, **kw):
    base = dict(model="tiny-gemma", length=448, ladder=LADDER, calib=(100,), heldout=(0,), top1=0.95, out=out)
    return TuneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_gemma):
    cfg = _cfg(tmp_path_factory.mktemp("tune"))
    return cfg, tune(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))


def test_the_choice_keeps_the_budget_and_nothing_cheaper_tried_does(tuned, tiny_gemma):
    cfg, cert = tuned
    chosen = next(s for s in cert["search"] if s["spec"] == cert["spec"])
    assert cert["quality_met_on_calibration"] and chosen["passes"] and chosen["top1"] >= cfg.top1
    for s in cert["search"]:
        assert s["passes"] == (s["top1"] >= cfg.top1)  # no usable retrieval task on a random model
        if s["bytes_per_token"] < chosen["bytes_per_token"]:
            assert not s["passes"]
    assert cert["calibration"]["indices"] == [100] and cert["heldout"]["indices"] == [0]
    assert cert["heldout"]["bytes_per_token"] < cert["heldout"]["bf16_bytes_per_token"]
    CompressedCache(tiny_gemma.config, cert["spec"])  # the spec runs on the model it was tuned for
    assert json.loads((cfg.out / "certificate.json").read_text())["spec"] == cert["spec"]
    assert len(cert["sensitivity_kl"]) == 4 and len(cert["sensitivity_kl"][0]) == len(LADDER)


def test_a_rerun_resumes_from_the_state_file(tuned):
    cfg, cert = tuned

    def no_model(name):
        raise AssertionError("everything was measured already")

    assert tune(cfg, load_model=no_model) == cert


def test_an_unreachable_bytes_target_is_reported(tuned, tiny_gemma):
    cfg, cert = tuned
    again = tune(_cfg(cfg.out, bytes=1.0), load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    assert again["bytes_met"] is False and again["spec"] == cert["spec"]


@pytest.mark.parametrize("kw, message", [
    (dict(calib=(0, 1), heldout=(1, 2)), "disjoint"),
    (dict(ladder=("bf16",)), "at least two"),
    (dict(ladder=("bf16", "fp8;sliding=bf16")), "one recipe"),
    (dict(ladder=("bf16", "fp8+topk:k=8")), "whole model"),
    (dict(tasks=("vartrack",)), "retrieval tasks"),
    (dict(tasks=("single", "report")), "calibration families only"),
    (dict(kv_apart=True, ladder=("bf16", "fp8:block=32")), "cannot be written as v="),  # v= has no block
    (dict(kv_apart=True, ladder=("bf16", "tova:keep=0.5+fp8")), "no keep policy"),
])
def test_bad_settings_are_refused(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        check_config(_cfg(tmp_path, **kw))


def test_cli_refuses_overlapping_instances_in_one_line(capsys, tmp_path):
    assert main(["tune", "--model", "smollm2-135m", "--length", "1024", "--calib", "0-1", "--heldout", "1-3",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disjoint" in err[0]


def test_path_buys_the_most_kl_per_byte_first_and_skips_dominated_rungs():
    kl = [[0, 0.1, 0.5], [0, 0.01, 0.02], [0, 0.2, 0.3]]
    size = [[10, 5, 2], [10, 5, 2], [10, 5, 12]]  # layer 2's cheapest-looking rung holds the most
    path = upgrade_path(kl, size)
    assert path[0] == (2, 2, 1) and path[1] == (1, 2, 1) and path[-1] == (0, 0, 0)
    costs = [sum(size[i][r] for i, r in enumerate(a)) for a in path]
    assert costs == sorted(costs) and all(2 not in (a[2],) for a in path)


def test_render_round_trips_through_the_grammar():
    assign = (0, 1, 1, 2, 1, 0)
    spec = render(assign, LADDER)
    assert spec == "fp8;layers[0,5]=bf16;layers[3]=int2:r=4,group=8"
    parsed = parse_method(spec)
    for i, a in enumerate(assign):
        assert parsed.recipe("full", i) == parse_method(LADDER[a]).full


def test_keys_and_values_apart_render_and_parse():
    ladder = ("bf16", "fp8", "nvfp4:rot=hadamard", "int2:r=32")
    assert kv_recipe("int2:r=32", "nvfp4:rot=hadamard") == "int2:r=32,keys=channel,rot=hadamard,v=nvfp4"
    assert kv_recipe("fp8", "fp8") == "fp8"
    assert kv_recipe("bf16", "int2:r=4,group=8,fit=lsq") == "bf16:r=4,keys=token,v=int2,vgroup=8,fit=lsq"
    assign = (2, 3, 2, 3, 1, 1, 2, 3)  # layers 0, 1, 3: NVFP4 keys, INT2 values; layer 2: FP8 both
    spec = render(assign, ladder, kv_apart=True)
    assert spec == "nvfp4:r=32,keys=token,rot=hadamard,v=int2;layers[2]=fp8"
    parsed = parse_method(spec)
    mixed = parsed.recipe("full", 0)
    assert (mixed.codec.name, mixed.value_codec.name, mixed.r) == ("nvfp4", "int2", 32)
    assert mixed.transforms == (Rotation("hadamard"),)
    assert parsed.recipe("full", 2) == parse_method("fp8").full


def test_tuning_keys_apart_from_values_measures_both_halves(tmp_path, tiny_gemma):
    cfg = _cfg(tmp_path, ladder=("bf16", "fp8", "int2:r=4"), kv_apart=True)
    cert = tune(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    layers = tiny_gemma.config.num_hidden_layers
    assert len(cert["sensitivity_kl"]) == 2 * layers and cert["kv_apart"]
    chosen = next(s for s in cert["search"] if s["spec"] == cert["spec"])
    assert chosen["passes"] or cert["spec"] == "bf16"
    CompressedCache(tiny_gemma.config, cert["spec"])  # what it prints is a spec the cache takes


@pytest.mark.parametrize("retrieval, top1, ok", [
    (0.66, 0.98, True),   # one point under bf16's 0.67: inside a 1-point budget
    (0.67, 0.98, True),
    (0.65, 0.98, False),  # two points under: out, whatever its top-1
    (0.90, 0.96, False),  # more retrieval does not buy back a top-1 under the floor
    (None, 0.97, True),   # no task bf16 passes: top-1 alone decides
])
def test_the_budget_bounds_retrieval_against_bf16_and_top1(tmp_path, retrieval, top1, ok):
    cfg = _cfg(tmp_path, max_drop=0.01, top1=0.97)
    assert passes({"retrieval": retrieval, "bf16_retrieval": 0.67, "top1": top1}, cfg) is ok


def test_tuning_on_the_calibration_families_certifies_the_worst_family(tmp_path, tiny_gemma, monkeypatch):
    from kvstrata_lab.bench import tune as tune_module

    asked = []
    real = tune_module.make_instance
    monkeypatch.setattr(tune_module, "make_instance",
                        lambda task, *a, **k: asked.append(task) or real(task, *a, **k))
    cfg = _cfg(tmp_path, tasks=("calib",), length=800, calib=(100, 101, 102, 103), heldout=(0, 1, 2, 3))
    cert = tune(cfg, load_model=lambda name: (tiny_gemma, byte_tokenizer()))
    assert set(asked) == {"calib", "fidelity"}  # never a report instance
    held = cert["heldout"]
    fams = set(held["delta_per_family"])
    assert fams == {"noise-magic", "reference-combination", "code-constant", "table-serial"}
    worst = held["worst_family"]
    assert worst["family"] in fams
    assert worst["ci95"][0] == min(d["ci95"][0] for d in held["delta_per_family"].values())
