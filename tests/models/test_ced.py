"""The encoder-decoder retrofit (`kvstrata.models.ced`): its fit, its half-depth runs, its directory."""

import copy

import pytest
import torch
from transformers import DynamicCache

from kvstrata.hf.cache import CompressedCache
from kvstrata.hf.projected import ProjectedLayer
from kvstrata.hf.run import NO_LOGITS, forward
from kvstrata.models.ced.distill import distill, student_logits, teacher
from kvstrata.models.ced.fit import fit_projections, solve_least_squares
from kvstrata.models.ced.model import Projections, decoder_shape, encoder_decoder
from kvstrata.models.ced.store import WEIGHTS, check_plan, fit_summary, write
from kvstrata.models.loader import install_dir, load_model
from kvstrata.models.tiny import save_tiny


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _fitted(base, split):
    return fit_projections(base, [_ids(64, s) for s in range(4)], [_ids(48, 9)], split)


def _exact(base, split):
    """Projections that give the one decoder layer of a Llama split at L-1 exactly its K/V
    (its input is H(split) itself: `k_proj(g * rms(H))` is linear in `rms(H)`)."""
    hidden, heads, dim, layers = decoder_shape(base.config)
    proj = Projections(hidden, heads, dim, layers - split)
    layer = base.model.layers[split]
    g = layer.input_layernorm.weight.detach().float()
    with torch.no_grad():
        w = torch.cat([layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]).float() * g
        proj.maps[0].weight.copy_(w)
        proj.maps[0].bias.zero_()
    return proj


def _reference(base, ids, prefill):
    """The original model's logits: prefill `prefill` tokens, then one token at a time."""
    cache = DynamicCache(config=base.config)
    out = [forward(base, ids[:, :prefill], cache, logits_to_keep=prefill)]
    out += [forward(base, ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_equal_the_original_while_the_prompt_fits_the_window(arch, tiny_llama, tiny_gemma):
    # bf16 weights: the bf16 codec then stores the encoder's K/V exactly, as DynamicCache does
    base = copy.deepcopy(tiny_llama if arch == "llama" else tiny_gemma).to(torch.bfloat16)
    proj, _ = _fitted(base, 2)
    ids = _ids(14, 1)
    want = _reference(base, ids, 10)
    ced = encoder_decoder(base, proj, 2, n_win=16)
    cache = CompressedCache(ced.config, "bf16", fused=False)
    out = [forward(ced, ids[:, :10], cache, logits_to_keep=10)]
    out += [forward(ced, ids[:, i : i + 1], cache) for i in range(10, 14)]
    got = torch.cat(out, 1)
    torch.testing.assert_close(got, want)


def test_exact_projections_make_any_length_equal_the_original(tiny_llama):
    """With projections that reproduce the decoder's K/V exactly, reading projected K/V outside the
    window changes nothing: masks, positions, RoPE and the deferred rows are right."""
    base = copy.deepcopy(tiny_llama)
    ids = _ids(60, 2)
    want = _reference(base, ids, 50)
    ced = encoder_decoder(base, _exact(base, 3), 3, n_win=8)
    cache = CompressedCache(ced.config, "bf16", fused=False)
    for a in range(0, 40, 16):  # chunks whose logits nobody asks for: the decoder waits
        assert forward(ced, ids[:, a : min(a + 16, 40)], cache, logits_to_keep=NO_LOGITS).shape[1] == 0
    out = [forward(ced, ids[:, 40:50], cache, logits_to_keep=5)]
    out += [forward(ced, ids[:, i : i + 1], cache) for i in range(50, 60)]
    got = torch.cat(out, 1)
    # the encoder read its earlier chunks through the bf16 codec: close, not bit-equal
    torch.testing.assert_close(got, want[:, 45:], atol=5e-3, rtol=0)
    assert cache.layers[3].own_rows == 8  # the own window, not the whole context


def test_the_decoder_runs_over_the_window_only(tiny_llama):
    base = copy.deepcopy(tiny_llama)
    ced = encoder_decoder(base, _exact(base, 3), 3, n_win=8)
    seen = []
    hook = base.model.layers[3].register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[1]))
    try:
        forward(ced, _ids(40, 3), CompressedCache(ced.config, "bf16", fused=False))
    finally:
        hook.remove()
    assert seen == [8]


def test_fit_is_the_least_squares_solution():
    x = torch.randn(500, 12, generator=torch.Generator().manual_seed(0))
    w, b = torch.randn(5, 12), torch.randn(5)
    y = x @ w.T + b + 0.01 * torch.randn(500, 5)
    got_w, got_b = solve_least_squares(x, y)
    sol = torch.linalg.lstsq(torch.cat([x, torch.ones(500, 1)], 1).double(), y.double()).solution
    torch.testing.assert_close(got_w, sol[:-1].T, atol=1e-8, rtol=1e-6)
    torch.testing.assert_close(got_b, sol[-1], atol=1e-8, rtol=1e-6)
    exact_w, exact_b = solve_least_squares(x, x @ w.T + b)
    torch.testing.assert_close(exact_w.float(), w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exact_b.float(), b, atol=1e-5, rtol=1e-5)


def test_fit_recovers_a_planted_linear_layer(tiny_llama):
    """The first decoder layer's K/V are linear in rms(H(split)): the fit finds that map."""
    base = copy.deepcopy(tiny_llama)
    proj, report = _fitted(base, 3)
    assert report.key_error[0] < 1e-3 and report.value_error[0] < 1e-3
    torch.testing.assert_close(proj.maps[0].weight, _exact(base, 3).maps[0].weight, atol=2e-3, rtol=0)


def test_the_saved_directory_round_trips(tmp_path, tiny_llama):
    source = save_tiny(tmp_path / "src", "llama")
    base = load_model(source)
    proj, report = _fitted(base, 2)
    target = install_dir(
        tmp_path / "ced", lambda tmp: write(tmp, source, base, proj, 2, 16, fit_summary(report))
    )
    back = load_model(target)
    assert (back.split, back.n_win) == (2, 16)
    for a, b in zip(back.projections.state_dict().values(), proj.state_dict().values()):
        assert torch.equal(a, b)
    ced = encoder_decoder(load_model(source), proj, 2, 16)
    ids = _ids(30, 4)
    got = [
        forward(m, ids, CompressedCache(m.config, "bf16", fused=False), logits_to_keep=3) for m in (back, ced)
    ]
    assert torch.equal(got[0], got[1])


def test_a_bad_plan_is_one_clear_line(tmp_path, tiny_llama):
    for split in (0, 4):
        with pytest.raises(ValueError, match=r"split must be a layer in \[1, 3\]"):
            check_plan(tiny_llama.config, split, 16)
    with pytest.raises(ValueError, match="n_win must be >= 1"):
        check_plan(tiny_llama.config, 2, 0)
    source = save_tiny(tmp_path / "src", "llama")
    base = load_model(source)
    proj, report = _fitted(base, 2)
    target = install_dir(
        tmp_path / "ced", lambda tmp: write(tmp, source, base, proj, 2, 16, fit_summary(report))
    )
    (target / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="projections .* cannot be read"):
        load_model(target)


def test_an_encoder_decoder_cache_takes_codecs_only(tiny_llama):
    base = copy.deepcopy(tiny_llama)
    ced = encoder_decoder(base, _exact(base, 3), 3, n_win=8)
    with pytest.raises(ValueError, match="codecs only, not keep policies"):
        CompressedCache(ced.config, "snapkv:keep=0.5+nvfp4")


def test_the_distillation_trains_what_the_model_runs(tiny_llama):
    """The training forward equals the encoder-decoder's own prefill on the window's rows, and a
    few seeded steps lower its loss."""
    base = copy.deepcopy(tiny_llama)
    proj, _ = _fitted(base, 2)
    ids = _ids(40, 5)
    h, _ = teacher(base, ids, 2, 8)
    types = ["full_attention"] * 4
    with torch.no_grad():
        trained = student_logits(base, proj, h, 2, 8, types, typed=False)
    ced = encoder_decoder(copy.deepcopy(base), proj, 2, n_win=8)
    ran = forward(ced, ids, CompressedCache(ced.config, "bf16", fused=False), logits_to_keep=8)
    torch.testing.assert_close(trained, ran, atol=2e-3, rtol=0)  # the cache's bf16 codec, nothing else
    texts = [_ids(40, s) for s in range(3)]
    report = distill(base, proj, texts, 2, 8, minutes=10, seed=0, lr=1e-2, max_steps=20)
    assert report.steps == 20 and report.loss_last < report.loss_first
    assert all(p.requires_grad for p in base.parameters())  # the model is left as it was


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_query_reads_each_position_of_its_span_once(arch, tiny_llama, tiny_gemma, monkeypatch):
    """Over chunked prefills and decode steps, a decoder query at t reads every position of its span
    (all of [0, t], or a sliding layer's window) exactly once: projected or own, never both."""
    base = copy.deepcopy(tiny_llama if arch == "llama" else tiny_gemma)
    proj, _ = _fitted(base, 2)
    ced = encoder_decoder(base, proj, 2, n_win=8)
    checked = []
    real = ProjectedLayer.mask

    def mask(self, start, rows, dtype):
        out = real(self, start, rows, dtype)
        p0, n_p = self.staged[2], self.staged[0].shape[-2]
        positions = list(range(p0, p0 + n_p)) + list(range(self.own_start, start + rows))
        for r in range(rows):
            t = start + r
            seen = [pos for pos, m in zip(positions, out[0, 0, r].tolist()) if m == 0]
            lo = 0 if self.sliding_window is None else max(0, t - self.sliding_window + 1)
            assert sorted(seen) == list(range(lo, t + 1)), (t, seen)
        checked.append(self.is_sliding)
        return out

    monkeypatch.setattr(ProjectedLayer, "mask", mask)
    cache = CompressedCache(ced.config, "nvfp4", fused=False)
    ids = _ids(70, 6)
    for a in range(0, 48, 16):
        forward(ced, ids[:, a : a + 16], cache, logits_to_keep=NO_LOGITS)
    forward(ced, ids[:, 48:60], cache, logits_to_keep=1)
    for i in range(60, 70):
        forward(ced, ids[:, i : i + 1], cache)
    assert len(checked) == 11 * 2 and (arch == "llama" or any(checked))
