import torch

from kvstrata_lab.bench.depth_similarity import layer_kv, plot, similarity


def test_similarity_on_tiny_gemma(tiny_gemma, tmp_path):
    k, v = layer_kv(tiny_gemma, torch.randint(0, 256, (1, 40)))
    assert k.shape == (4, 2, 15, 32)  # sliding layers hold 15 positions: compared on those
    r = similarity(k, v, group=2)
    assert len(r["k_cos"]) == 3 and len(r["k_low"]) == 2 and len(r["k_cos"][0]) == 2
    assert all(0.0 <= x <= 1.0 for row in r["k_low"] for x in row)
    plot(r, "tiny", tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_identical_layers_score_one():
    k = torch.randn(1, 2, 10, 8).expand(4, -1, -1, -1)
    r = similarity(k, k, group=4)
    assert all(abs(x - 1) < 1e-5 for row in r["k_cos"] for x in row)
    assert all(abs(x - 1) < 1e-5 for row in r["v_low"] for x in row)
