"""Run a model over a compressed cache through public transformers APIs only."""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
import resource
from dataclasses import dataclass

import torch

from kvstrata.hf.cache import CompressedCache, head_dim, layer_classes
from kvstrata.hf.topk_attention import reading
from kvstrata.methods import MethodSpec, parse_method
from kvstrata.settings import GenerateConfig


def cache_kwarg(model) -> str:
    """Name of the forward argument that takes the cache (`cache` from transformers 5.24 on)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int = 1,
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One forward pass appending `input_ids: [batch, tokens]` to `cache`; logits of the last
    `logits_to_keep` positions: `[batch, logits_to_keep, vocab]`. `position_ids` override the
    positions the model derives from the cache's length (for caches that dropped entries)."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                    **{cache_kwarg(model): cache}, **extra)
    return out.logits


def decode_steps(model, cache, logits: torch.Tensor, steps: int, spec: str | MethodSpec = "bf16",
                 forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy decode steps from a prompt's `cache` and next-token `logits: [1, vocab]`, each
    step one token read as `spec` says (top-k reads included), as a server decodes. With `forced`
    those tokens are fed instead (another run's greedy tokens: where this cache would choose
    otherwise). Returns the tokens fed and the logits before each, `[steps, vocab]`."""
    tokens: list[int] = []
    rows = [logits[0]]
    with torch.inference_mode(), reading(model, cache, spec):
        for i in range(steps):
            tokens.append(int(rows[-1].argmax()) if forced is None else forced[i])
            if i + 1 < steps:
                rows.append(forward(model, torch.tensor([tokens[-1:]]), cache)[0, -1])
    return tokens, torch.stack(rows)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bf16_bytes_per_token(config, tokens: int) -> float:
    """Reference: what an uncompressed bf16 cache of this model holds per token after `tokens` tokens
    (sliding layers hold at most `window - 1`). The `bf16` method's measured bytes equal this."""
    text = config.get_text_config(decoder=True)
    per_layer_token = 2 * text.num_key_value_heads * head_dim(text) * 2
    held = sum(tokens if cls == "full" else min(tokens, window - 1) for cls, window in layer_classes(config))
    return held * per_layer_token / tokens if tokens else 0.0


@dataclass
class Generation:
    text: str
    new_tokens: list[int]
    context_tokens: int
    kv_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_token_bf16: float
    cache: CompressedCache | None = None  # what the generation left: encoded K/V, `nbytes()`


PREFILL_CHUNK = GenerateConfig.prefill_chunk


def _malloc_trim():
    """glibc's `malloc_trim`, or a no-op elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda pad: 0


_TRIM = _malloc_trim()


def prefill_chunked(model, cache, ids: torch.Tensor, chunk: int = PREFILL_CHUNK) -> None:
    """Feed `ids: [1, n]` into `cache` `chunk` tokens at a time (logits of the last position only).
    Between chunks, freed heap pages go back to the OS: each chunk's transient full-precision
    tensors would otherwise stay resident (allocator fragmentation) and grow with the context."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1 token, got {chunk}")
    for start in range(0, ids.shape[1], chunk):
        forward(model, ids[:, start : start + chunk], cache)
        _TRIM(0)


def generate(model, tokenizer, prompt_ids: torch.Tensor, method: str | MethodSpec,
             max_new_tokens: int = GenerateConfig.max_new_tokens,
             prefill_chunk: int | None = PREFILL_CHUNK) -> Generation:
    """Greedy `model.generate` over a `CompressedCache`; `prompt_ids: [1, tokens]`. All but the last
    prompt token are prefilled `prefill_chunk` at a time (None: in one pass). Methods with a keep
    policy see the whole prompt at once (the policy acts once, after the prefill)."""
    spec = parse_method(method) if isinstance(method, str) else method
    cache = CompressedCache(model.config, spec)

    keeps = any(r.keep is not None for r in spec.recipes())
    chunked = prefill_chunk is not None and not keeps and prompt_ids.shape[1] > 1
    with torch.inference_mode(), reading(model, cache, spec):
        if chunked:
            prefill_chunked(model, cache, prompt_ids[:, :-1], prefill_chunk)
        out = model.generate(
            input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **{cache_kwarg(model): cache},
        )
    new = out[0, prompt_ids.shape[1]:].tolist()
    cache.shrink()  # rows reserved for further decode steps are not part of what the cache stores
    seen = cache.get_seq_length()
    total = cache.nbytes()["total"]
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        new_tokens=new,
        context_tokens=prompt_ids.shape[1],
        kv_bytes=total,
        kv_bytes_per_token=total / seen if seen else 0.0,
        kv_bytes_per_token_bf16=bf16_bytes_per_token(model.config, seen),
        cache=cache,
    )
