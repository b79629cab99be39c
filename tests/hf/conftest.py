import pytest
import torch

from kvstrata.hf.run import forward


@pytest.fixture(params=["llama", "gemma3"])
def model(request, tiny_llama, tiny_gemma):
    """Each test taking `model` runs on tiny Llama and tiny Gemma-3."""
    return tiny_llama if request.param == "llama" else tiny_gemma


def _decode_logits(model, cache, ids, prefill=40):
    out = [forward(model, ids[:, :prefill], cache, logits_to_keep=prefill)]
    out += [forward(model, ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.fixture
def decode_logits():
    """`decode_logits(model, cache, ids)`: prefill 40 tokens, then decode the rest one at a time;
    the logits of every position from the prefill on."""
    return _decode_logits
