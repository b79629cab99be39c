"""The contract every registered store codec keeps, as one suite a test class inherits.

A subclass provides the class-scoped fixture `codec_name` (a registered store codec); the
tolerances come from the codec's registry entry, so a new codec needs no table edited here.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvstrata import quantize
from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, generate
from kvstrata.methods import METHODS
from kvstrata.models.tiny import byte_tokenizer


def tensors(max_rows=4, max_cols=80):
    shapes = st.tuples(st.integers(1, max_rows), st.integers(1, max_cols))
    return shapes.flatmap(
        lambda s: st.lists(
            st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=s[0] * s[1], max_size=s[0] * s[1]
        ).map(lambda v: torch.tensor(v, dtype=torch.float32).reshape(s))
    )


def cache_spec(name: str) -> str:
    """The method spec that stores every token with the codec (no full-precision residual)."""
    return f"{name}:r=0" if METHODS[name].defaults.get("r", 0) else name


def run(model, cache, ids, prefill):
    logits = [forward(model, ids[:, :prefill], cache, logits_to_keep=prefill)]
    for i in range(prefill, ids.shape[1]):
        logits.append(forward(model, ids[:, i : i + 1], cache))
    return torch.cat(logits, dim=1)


class CodecContract:
    """Properties (shape / dtype, idempotence, bytes held, error bounds) and the cache contract
    (decoding over the encoded cache tracks dense, nbytes is what is held, works in generate)."""

    @pytest.fixture(params=["llama", "gemma3"])
    def model(self, request, tiny_llama, tiny_gemma):
        return tiny_llama if request.param == "llama" else tiny_gemma

    @settings(max_examples=60, deadline=None)
    @given(x=tensors())
    def test_idempotent(self, codec_name, x):
        q1 = quantize(x, codec_name)
        q2 = quantize(q1.dequantize(), codec_name)
        for name, part in q1.parts.items():
            if name == "tensor_scale":  # fp32 amax / 2688 may move by an ulp; codes and block scales may not
                torch.testing.assert_close(q2.parts[name], part, rtol=1e-6, atol=0)
            else:
                assert torch.equal(q2.parts[name], part), name
        torch.testing.assert_close(q2.dequantize(), q1.dequantize(), rtol=1e-6, atol=0)

    @settings(max_examples=40, deadline=None)
    @given(x=tensors())
    def test_shape_dtype_and_bytes_held(self, codec_name, x):
        q = quantize(x, codec_name)
        d = q.dequantize()
        assert d.shape == x.shape and d.dtype == x.dtype
        assert q.nbytes == sum(t.numel() * t.element_size() for t in q.parts.values())

    def test_random_error_bounds(self, codec_name):
        tol = METHODS[codec_name].tolerance
        torch.manual_seed(0)
        x = torch.randn(64, 64) * torch.logspace(-1, 1, 64)[:, None]  # within NVFP4 scale range
        d = quantize(x, codec_name).dequantize()
        err = (d - x).abs().reshape(64, -1, tol.block)
        amax = x.abs().reshape(64, -1, tol.block).amax(-1, keepdim=True)
        assert (err <= tol.element * amax + 1e-12).all()
        # and the typical error is far below the worst case
        assert (err / amax).mean() < tol.element / 2

    def test_decoding_over_encoded_cache_tracks_dense(self, model, codec_name):
        ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(1))
        ref = run(model, DynamicCache(config=model.config), ids, 40)
        cache = CompressedCache(model.config, cache_spec(codec_name))
        got = run(model, cache, ids, 40)
        # the prefill itself attends in full precision: identical
        torch.testing.assert_close(got[:, :40], ref[:, :40], rtol=0, atol=1e-4)
        assert (got[:, 40:] - ref[:, 40:]).abs().mean() < METHODS[codec_name].tolerance.logits
        assert cache.get_seq_length() == 72

    def test_nbytes_is_what_is_held(self, model, codec_name):
        cache = CompressedCache(model.config, cache_spec(codec_name))
        forward(model, torch.randint(0, 256, (1, 50)), cache)
        report = cache.nbytes()
        assert report["total"] == sum(report["layers"]) > 0
        for layer, n in zip(cache.layers, report["layers"]):
            held = {}
            for seg in layer.segments:
                for t in seg.parts():
                    held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            for t in (layer.keys, layer.values):
                held[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            assert n == sum(held.values())

    def test_works_inside_generate(self, model, codec_name):
        tok = byte_tokenizer()
        ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
        g = generate(model, tok, ids, cache_spec(codec_name), max_new_tokens=6)
        assert len(g.new_tokens) == 6
        assert g.kv_bytes_per_token > 0
