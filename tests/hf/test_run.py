"""`generate` and chunked prefill over a CompressedCache."""

import pytest
import torch

from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, generate, prefill_chunked
from kvstrata.models.tiny import byte_tokenizer


@pytest.mark.parametrize("spec", ["bf16", "nvfp4", "int2:r=8", "nvfp4;sliding=fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_holds_what_one_pass_holds(spec, arch, tiny_llama, tiny_gemma):
    model = tiny_llama if arch == "llama" else tiny_gemma
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(0))
    one, chunked = CompressedCache(model.config, spec), CompressedCache(model.config, spec)
    a = forward(model, ids, one)
    prefill_chunked(model, chunked, ids[:, :-1], chunk=32)
    b = forward(model, ids[:, -1:], chunked)
    assert chunked.get_seq_length() == one.get_seq_length() == 150
    assert [layer.stored_tokens() for layer in chunked.layers] == [layer.stored_tokens()
                                for layer in one.layers]
    # later chunks attend to the earlier ones as stored (encoded): close to one full-precision pass
    assert (a[0, -1] - b[0, -1]).abs().max() < (0.05 if spec == "bf16" else 1.0)


def test_generate_chunked_and_in_one_pass(tiny_llama):
    tok = byte_tokenizer()
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    whole = generate(tiny_llama, tok, ids, "bf16", max_new_tokens=4, prefill_chunk=None)
    chunked = generate(tiny_llama, tok, ids, "bf16", max_new_tokens=4, prefill_chunk=16)
    assert len(chunked.new_tokens) == 4 and chunked.context_tokens == 90
    assert chunked.kv_bytes == whole.kv_bytes  # spare rows given back: bytes are exactly the tokens held
    with pytest.raises(ValueError, match="prefill chunk"):
        prefill_chunked(tiny_llama, CompressedCache(tiny_llama.config, "bf16"), ids, chunk=0)
