"""Real models, offline: a 4,000-token passkey through `generate` with FP4 caches, bytes hand-counted."""

import pytest

from kvstrata.hf.run import PREFILL_CHUNK, generate, prefill_spans
from kvstrata.models import KNOWN_MODELS, load
from kvstrata.settings import GenerateConfig
from kvstrata_lab.bench.passkey import passkey_prompt

pytestmark = pytest.mark.integration

# bytes one token's K (or V) row takes in one layer, by codec, for head_dim 64 / 256 and the KV heads
ROW = {"mxfp4": lambda d: d // 32 * 17, "nvfp4": lambda d: d // 16 * 9, "bf16": lambda d: 2 * d}


def held_tokens(model, tokens):
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return sum(tokens if t == "full_attention" else min(tokens, text.sliding_window - 1) for t in types)


# the models `make setup` installs (the Qwen models have their own file: tests/integration/test_qwen.py)
@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request):
    if not KNOWN_MODELS[request.param].installed():
        pytest.fail(f"{request.param} missing: {KNOWN_MODELS[request.param].install_command}")
    model, tok = load(request.param)
    p = passkey_prompt(tok, 4000, depth=0.5, seed=3)
    ids = tok(p.context + p.question, return_tensors="pt").input_ids
    return request.param, model, tok, p, ids


@pytest.mark.parametrize("method", ["mxfp4", "nvfp4"])
def test_passkey_4k_through_fp4_cache(real, method):
    name, model, tok, p, ids = real
    assert ids.shape[1] == 4000  # the prompt is exactly the length asked
    g = generate(model, tok, ids, method, max_new_tokens=6)
    assert p.answer in g.text, f"{name}/{method} answered {g.text!r}, key {p.answer}"
    # hand count: codes + block scales per K/V row, every held token, every layer
    text = model.config.get_text_config()
    seen = ids.shape[1] + 6 - 1  # the last generated token is never fed back
    rows = 2 * text.num_key_value_heads * held_tokens(model, seen)
    expected = rows * ROW[method](text.head_dim)
    if method == "nvfp4":  # one fp32 tensor scale per encoded K/V segment: one per prefill chunk a layer
        # still holds, then the decode steps' (one, and another whenever a token outgrows its scale)
        segments = [len(layer.segments) for layer in g.cache.layers]
        spans = [b - a for a, b in prefill_spans(ids.shape[1], PREFILL_CHUNK, GenerateConfig.store_block)]
        for layer in g.cache.layers:
            if not layer.is_sliding:
                runs = [s.visible for s in layer.segments]
                assert runs[:len(spans)] == spans and sum(runs[len(spans):]) == 5
        expected += 2 * 4 * sum(segments)
    assert g.kv_bytes == expected
    if name == "smollm2-135m":
        assert g.kv_bytes_per_token_bf16 == 23040  # 30 layers x 2 x 3 heads x 64 x 2 B
        assert 3.5 < g.kv_bytes_per_token_bf16 / g.kv_bytes_per_token < 3.8
