"""Cache byte counts and generate on tiny Llama and Gemma-3 models (the per-codec cache contract runs
for every registered codec in tests/codecs/codec_contract.py)."""

import pytest
import torch

from kvstrata.hf import CompressedCache
from kvstrata.hf.run import bf16_bytes_per_token, forward, generate
from kvstrata.models.tiny import byte_tokenizer


def test_bf16_bytes_equal_hand_count(model):
    cache = CompressedCache(model.config, "bf16")
    n = 40
    forward(model, torch.randint(0, 256, (1, n)), cache)
    text = model.config.get_text_config()
    per_token_layer = 2 * text.num_key_value_heads * text.head_dim * 2
    windows = [getattr(layer, "sliding_window", None) for layer in cache.layers]
    expected = [per_token_layer * (min(n, w - 1) if w else n) for w in windows]
    assert cache.nbytes()["layers"] == expected
    assert cache.bytes_per_token() == pytest.approx(bf16_bytes_per_token(model.config, n))


def test_generate_equals_manual_greedy_loop(tiny_llama):
    tok = byte_tokenizer()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    g = generate(tiny_llama, tok, ids, "nvfp4:r=4", max_new_tokens=5)
    cache = CompressedCache(tiny_llama.config, "nvfp4:r=4")
    logits = forward(tiny_llama, ids, cache)
    manual = []
    for _ in range(5):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        manual.append(nxt.item())
        logits = forward(tiny_llama, nxt, cache)
    assert g.new_tokens == manual
