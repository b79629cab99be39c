"""`kvstrata tune --keep`: every candidate fits the bytes with the largest keep fraction that does,
the best on calibration is certified on held-out instances, and bad settings are refused."""

import pytest

from kvstrata.cli import main
from kvstrata.hf import CompressedCache
from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.tune import Evaluator, TuneConfig
from kvstrata_lab.bench.tune_keep import check_keep, compose, fit_keep, rank, tune_keep

LADDER = ("bf16", "fp8", "int2:r=4,group=8")
BF16 = 4 * 2 * 2 * 32 * 2  # tiny-llama: 4 layers x 2 KV heads x (K, V) x 32 dims x 2 bytes


def _cfg(out, **kw):
    base = dict(model="tiny-llama", length=448, ladder=LADDER, calib=(100,), heldout=(0,), top1=0.5,
                bytes=0.3 * BF16, out=out)
    return TuneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_llama):
    cfg = _cfg(tmp_path_factory.mktemp("tune-keep"))
    load = lambda name: (tiny_llama, byte_tokenizer())  # noqa: E731
    return cfg, tune_keep(cfg, "tova", load_model=load), load


def test_every_candidate_keeps_the_most_tokens_that_fit_the_bytes(searched):
    cfg, cert, load = searched
    rungs = [s["spec"].partition("+")[2] or "bf16" for s in cert["search"]]
    assert rungs == list(LADDER) and all(s["spec"].startswith("tova:keep=0.") for s in cert["search"])
    ev = Evaluator(cfg, load)
    for s in cert["search"]:
        assert s["bytes_per_token"] <= cfg.bytes
        keep = float(s["spec"].split("+")[0].removeprefix("tova:keep="))
        rung = s["spec"].partition("+")[2] or "bf16"
        more = compose("tova", keep + 0.01, rung)  # one hundredth more would be over
        over = [ev.run(t, cfg.calib[0], [more])[more]["bytes_per_token"] for t in cfg.tasks]
        assert max(over) > cfg.bytes
    # cheaper codes keep more tokens
    keeps = [float(s["spec"].split("+")[0].removeprefix("tova:keep=")) for s in cert["search"]]
    assert keeps == sorted(keeps) and keeps[0] < keeps[-1]


def test_the_best_on_calibration_is_certified_on_held_out_instances(searched, tiny_llama):
    cfg, cert, _ = searched
    best = max(cert["search"], key=lambda s: (s["passes"], s["retrieval"] or 0.0, s["top1"], -s["kl"]))
    assert cert["spec"] == best["spec"] and cert["keep"] == "tova"
    assert cert["calibration"]["indices"] == [100] and cert["heldout"]["indices"] == [0]
    assert cert["bytes_met"] == (cert["heldout"]["bytes_per_token"] <= cfg.bytes)
    assert cert["heldout"]["bytes_per_token"] <= 1.02 * cfg.bytes  # held-out contexts vary a little
    assert cert["heldout"]["compression"] > 3
    CompressedCache(tiny_llama.config, cert["spec"])  # the spec runs on the model it was tuned for


def test_a_rung_that_already_fits_is_kept_whole(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path, bytes=float(BF16))
    ev = Evaluator(cfg, lambda name: (tiny_llama, byte_tokenizer()))
    assert fit_keep(ev, cfg, "tova", "fp8") == "fp8"
    assert compose("tova", 0.5, "bf16") == "tova:keep=0.50"


def test_the_ranking_puts_the_budget_first_then_retrieval():
    cfg = _cfg(".", max_drop=0.01, top1=0.9)
    ok = {"retrieval": 0.5, "bf16_retrieval": 0.5, "top1": 0.91, "kl": 0.3}
    better_but_out = {"retrieval": 0.9, "bf16_retrieval": 0.5, "top1": 0.89, "kl": 0.1}
    assert rank(ok, cfg) > rank(better_but_out, cfg)
    assert rank({**ok, "retrieval": 0.6}, cfg) > rank(ok, cfg)


@pytest.mark.parametrize("kw, policy, message", [
    (dict(bytes=None), "tova", "give --bytes"),
    (dict(kv_apart=True), "tova", "--kv-apart"),
    (dict(), "fp8", "'fp8' is not a keep policy"),
    (dict(), "nosuch", "--keep 'nosuch'"),
    (dict(ladder=("bf16", "snapkv:keep=0.5+fp8")), "tova", "its own keep policy"),
    (dict(calib=(0,), heldout=(0,)), "tova", "disjoint"),
])
def test_bad_settings_are_refused(tmp_path, kw, policy, message):
    with pytest.raises(ValueError, match=message):
        check_keep(_cfg(tmp_path, **kw), policy)


def test_cli_refuses_keep_without_bytes_in_one_line(capsys, tmp_path):
    assert main(["tune", "--model", "smollm2-135m", "--length", "1024", "--keep", "tova",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bytes" in err[0]
