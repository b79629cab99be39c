"""`kvstrata tune --keep POLICY --layer-keep mass`: layers whose attention is spread keep more tokens,
the mean fraction meets the budget, the spec parses, and the search fits the bytes on a tiny model."""

import pytest
import torch

from kvstrata.cli import main
from kvstrata.codecs import Rotation
from kvstrata.methods import parse_method
from kvstrata.models.tiny import byte_tokenizer
from kvstrata_lab.bench.layer_keep import allocate, lost_mass, mass_curves, policy_scores, render_keep
from kvstrata_lab.bench.tune import Evaluator, TuneConfig, tune
from kvstrata_lab.bench.tune_keep import check_keep, compose, keep_curves, tune_keep

BF16 = 4 * 2 * 2 * 32 * 2  # tiny-llama: 4 layers x 2 KV heads x (K, V) x 32 dims x 2 bytes


def test_lost_mass_is_what_the_top_fraction_leaves_out():
    s = torch.tensor([0.05, 0.5, 0.0, 0.2, 0.1, 0.0, 0.15, 0.0, 0.0, 0.0])  # 10 tokens, sums to 1
    curve = lost_mass(s)
    assert len(curve) == 100 and curve[-1] == 0.0
    assert curve[9] == pytest.approx(0.5)  # 10 %: the top token (0.5) kept
    assert curve[29] == pytest.approx(0.15)  # 30 %: 0.5 + 0.2 + 0.15 kept
    assert curve[59] == pytest.approx(0.0, abs=1e-6)  # every token with mass kept
    assert all(a >= b for a, b in zip(curve, curve[1:]))


def test_spread_layers_keep_more_than_concentrated_ones_at_the_mean_asked():
    n = 200
    spread = torch.ones(n)
    sink = torch.cat([torch.tensor([100.0]), torch.ones(n - 1) * 0.01])
    curves = mass_curves([[spread, sink, None], [spread * 2, sink, None]])
    assert curves[2] is None and curves[0] == lost_mass(spread)
    for mean in (0.3, 0.5, 0.8):
        got = allocate(curves, mean)
        assert got[2] is None and got[0] > mean > got[1]
        assert (got[0] + got[1]) / 2 <= mean + 1e-9
        assert (got[0] + got[1]) / 2 >= mean - 0.02  # no budget left unspent beyond a hundredth a layer
    same = allocate([lost_mass(spread)] * 3, 0.4)
    assert same == [0.4, 0.4, 0.4]


def test_the_policy_scores_sum_its_window_and_average_the_kv_heads():
    rows = torch.arange(2 * 3 * 2, dtype=torch.float).reshape(1, 2, 3, 2)  # heads x window rows x 2 tokens
    # last two rows: head 0 rows (2, 3), (4, 5) -> (6, 8); head 1 rows (8, 9), (10, 11) -> (18, 20)
    assert policy_scores(rows, 2).tolist() == [12.0, 14.0]
    assert policy_scores(rows, 1).tolist() == [7.0, 8.0] and policy_scores(None, 1) is None


def test_the_rendered_spec_gives_each_layer_its_fraction():
    fractions = [0.9, 0.4, 0.4, 1.0, None, 0.4]
    spec = render_keep("tova", fractions, "int4:r=0,rot=hadamard")
    assert spec.startswith("tova:keep=0.40+int4")
    m = parse_method(spec)
    for i, f in enumerate(fractions):
        rec = m.recipe("full", i)
        assert rec.codec.name == "int4" and rec.transform(Rotation) == Rotation("hadamard")
        assert (rec.keep is None) if f == 1.0 else rec.keep.keep == (0.4 if f is None else f)
    assert render_keep("tova", [0.5, 0.5], "bf16") == "tova:keep=0.50"


def _cfg(out, **kw):
    base = dict(model="tiny-llama", length=448, ladder=("bf16", "int2:r=4,group=8"), calib=(100,),
                heldout=(0,), top1=0.5, bytes=0.3 * BF16, layer_keep="mass", out=out)
    return TuneConfig(**{**base, **kw})


def test_the_mass_split_search_fits_the_bytes_and_records_its_curves(tmp_path, tiny_llama):
    cfg = _cfg(tmp_path)
    load = lambda name: (tiny_llama, byte_tokenizer())  # noqa: E731
    cert = tune_keep(cfg, "tova", load_model=load)
    curves = cert["lost_mass_curves"]
    assert cert["layer_keep"] == "mass" and len(curves) == 4
    for s in cert["search"]:
        assert s["bytes_per_token"] <= cfg.bytes
        rung = s["spec"].partition(";")[0].partition("+")[2] or "bf16"
        # the spec is the curves' split at some mean fraction, and that mean keeps under 1
        means = [m / 100 for m in range(1, 100) if compose("tova", m / 100, rung, curves) == s["spec"]]
        assert means
        fractions = [parse_method(s["spec"]).recipe("full", i).keep for i in range(4)]
        assert sum(1.0 if k is None else k.keep for k in fractions) / 4 <= means[-1] + 1e-9
    assert cert["spec"] in [s["spec"] for s in cert["search"]]
    # the curves were kept: a resumed search reads them back without loading the model
    again = Evaluator(cfg, lambda name: pytest.fail("the curves should come from the state file"))
    assert keep_curves(again, cfg, "tova") == curves


@pytest.mark.parametrize("kw, policy, message", [
    (dict(), "streaming", "keeps without them"),
    (dict(layer_keep="pyramid"), "tova", "uniform or mass"),
])
def test_bad_settings_are_refused(tmp_path, kw, policy, message):
    with pytest.raises(ValueError, match=message):
        check_keep(_cfg(tmp_path, **kw), policy)


def test_a_split_without_a_keep_policy_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="give --keep"):
        tune(_cfg(tmp_path, bytes=None))
    assert main(["tune", "--model", "tiny-llama", "--length", "448", "--layer-keep", "mass",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep" in err[0]
