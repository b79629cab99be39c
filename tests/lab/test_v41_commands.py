"""`kvstrata v41-prefill` and `kvstrata train-ref` end to end on the tiny preset (numbers are not
asserted against targets here: those live in the benchmark)."""

import json

from safetensors import safe_open

from kvstrata.cli import main
from kvstrata.models.v41 import V41ForCausalLM
from kvstrata_lab.bench.results import ReportInput
from kvstrata_lab.bench.v41_prefill import report_section
from kvstrata_lab.v41_train import TrainConfig, _text_ids, batch


def test_v41_prefill_command(tmp_path):
    out = tmp_path / "prefill.json"
    assert main(["v41-prefill", "--preset", "tiny-v41", "--factor",
                "4", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompt_tokens"] == 4 * r["n_win"] and r["ced_prefill_s"] > 0 and r["full_depth_prefill_s"] > 0


def test_recall_batches_ask_each_key_once():
    import random

    cfg = TrainConfig(seq_len=64, pairs=4)
    ids, ask = batch(cfg, random.Random(1), _text_ids(), 3)
    assert ids.shape == (3, 64) and ask.sum() == 3 * 4
    for i in range(3):
        pairs = dict(zip(ids[i, :8:2].tolist(), ids[i, 1:8:2].tolist()))
        for q in ask[i].nonzero().flatten().tolist():
            assert pairs[int(ids[i, q])] == int(ids[i, q + 1])  # the asked key's value follows it


def test_train_ref_command_saves_both_models(tmp_path):
    out = tmp_path / "v41" / "train-ref"
    assert main(["train-ref", "--steps", "2", "--batch", "4", "--seq-len", "64",
                "--pairs", "4", "--eval-sequences", "8", "--out", str(out)]) == 0
    section = report_section(ReportInput(tmp_path))
    assert (
        "--steps 2" in section and "| V4.1 (CSA2 + CED) |" in section and "| dense transformer |" in section
    )
    tmp_path = out
    r = json.loads((tmp_path / "train_ref.json").read_text())
    assert set(r["models"]) == {"v41", "dense"}
    assert 0 <= r["models"]["v41"]["recall"] <= 1 and "recall_cached_fp4" in r["models"]["v41"]
    assert 0 <= r["models"]["v41"]["recall_dense_read"] <= 1
    with safe_open(str(tmp_path / "v41" / "model.safetensors"), "pt") as f:
        assert any(k.startswith("layers.") for k in f.keys())
    assert V41ForCausalLM.from_pretrained(tmp_path / "v41").config.layer_modes[2] == "full"


def test_train_ref_override_reaches_both_models_and_bad_json_is_refused(tmp_path, capsys):

    out = tmp_path / "v41" / "window16"
    args = ["train-ref", "--steps", "1", "--batch", "2", "--eval-sequences", "4", "--out", str(out)]
    assert main([*args, "--override", '{"sliding_window": 16}']) == 0
    assert V41ForCausalLM.from_pretrained(out / "v41").config.sliding_window == 16
    assert json.loads((out / "train_ref.json").read_text())["config"]["overrides"] == {"sliding_window": 16}
    # every run under DIR/v41 is reported, with the command that made it
    section = report_section(ReportInput(tmp_path))
    assert (
        "overrides sliding_window" in section
        and """--override '{"sliding_window": 16}' --out DIR/v41/window16""" in section
    )
    for bad, words in (
        ("{sliding", "not valid JSON"), ("[1]", "JSON object"),
        ('{"nosuch": 1}', "unknown V41Config fields nosuch"),
    ):
        assert main([*args, "--override", bad]) == 2
        assert words in capsys.readouterr().err
