import torch
from transformers import DynamicCache

from kvstrata.hf.probe import probing
from kvstrata.hf.run import forward


def test_probe_matches_the_model_and_records(tiny_gemma):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    a, b = DynamicCache(config=tiny_gemma.config), DynamicCache(config=tiny_gemma.config)
    forward(tiny_gemma, ids[:, :30], a)
    forward(tiny_gemma, ids[:, :30], b)
    ref = forward(tiny_gemma, ids[:, 30:], a, logits_to_keep=10)
    with probing(tiny_gemma) as rec:
        got = forward(tiny_gemma, ids[:, 30:], b, logits_to_keep=10)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert tiny_gemma.config._attn_implementation != "kvstrata_probe"  # restored
    assert rec.queries[2].shape == (1, 4, 10, 32)  # layer 2 is global: 4 query heads, 10 window queries
    # sliding layers see their window
    assert rec.probs[2].shape == (1, 4, 10, 40) and rec.probs[0].shape[-1] <= 25
    torch.testing.assert_close(rec.probs[2].sum(-1), torch.ones(1, 4, 10))
