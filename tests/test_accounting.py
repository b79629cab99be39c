import json

import pytest
import torch

from kvstrata.accounting import account_hf
from kvstrata.cli import main
from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward
from kvstrata.models.v41_layout import cache_plan, compare, presets


def test_v41_flash_is_890_bytes_per_token():
    r = compare("v41-flash", "v4-flash")
    assert r["main_entry_bytes"] == 288 and r["index_key_bytes"] == 68
    assert r["global_kv_bytes_per_token"] == 890
    assert 1 / 4.5 < r["global_ratio_to_baseline"] < 1 / 3.5  # "about 1/4"
    assert 1 / 9 < r["persistent_ratio_to_baseline"] < 1 / 7  # "about 1/8", SWA not persisted
    assert r["persistent_bytes_per_token"] == r["global_kv_bytes_per_token"]


def test_v41_layer_modes_and_sources():
    plan = cache_plan(presets()["v41-flash"])
    modes = {p.layer: p.mode for p in plan}
    assert [i for i, m in modes.items() if m == "swa"] == [0, 1]
    assert [i for i, m in modes.items() if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in modes.items() if m == "reindex"] == [24, 28, 32, 36]
    assert all(p.m == 2 for p in plan[2:20]) and all(p.m == 1 for p in plan[20:])
    assert plan[5].source == 2 and plan[13].source == 8 and plan[19].source == 14
    assert all(p.source == 20 for p in plan[21:])
    # only Full layers store global KV: 3 encoder sources at m=2 and one decoder source at m=1
    assert [p.global_bytes_per_token + p.index_bytes_per_token for p in plan if p.mode ==
        "full"] == [178, 178, 178, 356]


def test_v4_flash_shape_from_transformers():
    v4 = presets()["v4-flash"]
    assert v4.layers == 43 and set(zip(v4.modes, v4.m)) == {("csa", 4), ("hca", 128)}


@pytest.mark.parametrize(
    "spec", ["bf16", "nvfp4", "mxfp4:r=5", "int2:group=8,r=3", "fp8;full=nvfp4", "streaming:keep=0.5+fp8"]
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hf_accounting_equals_allocated_bytes(spec, arch, tiny_llama, tiny_gemma):
    model = tiny_llama if arch == "llama" else tiny_gemma
    cache = CompressedCache(model.config, spec)
    forward(model, torch.randint(0, 256, (1, 45)), cache)
    report = account_hf(model.config, spec, 45)
    assert [r["bytes"] for r in report["layers"]] == cache.nbytes()["layers"]


def test_cli_accounting_json(capsys):
    assert main(["accounting", "--preset", "v41-flash", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["global_kv_bytes_per_token"] == 890 and len(r["layers"]) == 40
    assert main(["accounting", "--preset", "nope"]) == 2
    assert main(["accounting"]) == 2
