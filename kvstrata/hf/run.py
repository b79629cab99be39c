"""Run a model over a compressed cache through public transformers APIs only."""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
import resource
from dataclasses import dataclass, field

import torch

from kvstrata.hf.cache import CompressedCache, head_dim, layer_classes
from kvstrata.hf.held import seal
from kvstrata.hf.topk_attention import reading
from kvstrata.methods import MethodSpec, parse_method, storable
from kvstrata.settings import GenerateConfig


def cache_kwarg(model) -> str:
    """Name of the forward argument that takes the cache (`cache` from transformers 5.24 on)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


#: `logits_to_keep` asking for no logits (a prefill chunk whose logits would be thrown away): an
#: encoder-decoder model then leaves its decoder's rows for the pass that asks (`kvstrata.models.ced`)
NO_LOGITS = torch.empty(0, dtype=torch.long)


def forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int | torch.Tensor = 1,
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
                 forced: list[int] | None = None,
                 stop: frozenset[int] = frozenset()) -> tuple[list[int], torch.Tensor]:
    """At most `steps` greedy decode steps from a prompt's `cache` and next-token `logits: [1, vocab]`,
    each step one token read as `spec` says (top-k reads included), as a server decodes; a token in
    `stop` (EOS) ends them. With `forced` those tokens are fed instead (another run's greedy tokens:
    where this cache would choose otherwise). Returns the tokens fed and the logits before each,
    `[tokens, vocab]`."""
    tokens: list[int] = []
    rows = [logits[0]]
    with torch.inference_mode(), reading(model, cache, spec):
        for i in range(steps):
            tokens.append(int(rows[-1].argmax()) if forced is None else forced[i])
            if i + 1 < steps and tokens[-1] not in stop:
                rows.append(forward(model, torch.tensor([tokens[-1:]]), cache)[0, -1])
            else:
                break
    return tokens, torch.stack(rows)


def store_boundary(n: int, block: int | None) -> int | None:
    """The last multiple of `block` before an `n`-token prompt's last token: where a server stores
    the prompt's blocks up to (it keeps >= 1 token to compute the next-token logits)."""
    return (n - 1) // block * block if block else None


def chunk_end(pos: int, n: int, chunk: int | None, block: int | None) -> int:
    """Where the chunk of an `n`-token prompt starting at `pos` ends: after at most `chunk` tokens
    (None: the rest), never across a multiple of `block` up to `store_boundary` -- where a server
    seals the cache and stores blocks.
    The one rule `generate` and `kvstrata serve` both cut by (a replay too): a lossy cache encodes
    a prompt by its chunks, and a chunk attends its own K/V before they are encoded."""
    end = n if chunk is None else min(n, pos + chunk)
    last = store_boundary(n, block)
    if last is not None and pos < last:
        end = min(end, (pos // block + 1) * block)
    return end


def sealed_at(pos: int, n: int, block: int | None) -> bool:
    """Whether a prompt fed up to `pos` stands on a block boundary a server seals (`held.seal`)."""
    last = store_boundary(n, block)
    return last is not None and 0 < pos <= last and pos % block == 0


def prefill_spans(n: int, chunk: int | None, block: int | None, start: int = 0) -> list[tuple[int, int]]:
    """The chunks `[a, b)` an `n`-token prompt is fed in from `start`, as `kvstrata serve` feeds it."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1 token, got {chunk}")
    spans = []
    while start < n:
        spans.append((start, end := chunk_end(start, n, chunk, block)))
        start = end
    return spans


def eos_ids(model) -> frozenset[int]:
    """The token ids that end a generation (the model's generation config)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else eos or [])


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
    #: per new token, its logit's lead over the runner-up: how near a tie each greedy choice was
    margins: list[float] = field(default_factory=list)


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
        forward(model, ids[:, start : start + chunk], cache, logits_to_keep=NO_LOGITS)
        _TRIM(0)


def generate(model, tokenizer, prompt_ids: torch.Tensor, method: str | MethodSpec,
             max_new_tokens: int = GenerateConfig.max_new_tokens,
             prefill_chunk: int | None = PREFILL_CHUNK,
             store_block: int | None = GenerateConfig.store_block) -> Generation:
    """Greedy decoding over a `CompressedCache`; `prompt_ids: [1, tokens]`. The prompt is fed as
    `kvstrata serve` feeds it (`prefill_spans`: at most `prefill_chunk` tokens, cut and sealed at
    each `store_block` boundary before its last token; None: in one pass), so a lossy cache holds
    what the server's does, whether the server computed the prompt or read it from its store.
    Methods with a keep policy see the whole prompt at once (the policy acts once, after the
    prefill). Stops at the model's EOS."""
    spec = parse_method(method) if isinstance(method, str) else method
    cache = CompressedCache(model.config, spec)
    keeps = any(r.keep is not None for r in spec.recipes())
    n, block = prompt_ids.shape[1], store_block if storable(spec) else None
    spans = [(0, n)] if keeps or prefill_chunk is None else prefill_spans(n, prefill_chunk, block)
    with torch.inference_mode(), reading(model, cache, spec):
        for a, b in spans:
            logits = forward(model, prompt_ids[:, a:b], cache, logits_to_keep=1 if b == n else NO_LOGITS)
            if sealed_at(b, n, block):  # never the last span's end (the prompt's last token)
                seal(cache, block)
            _TRIM(0)
    new, rows = decode_steps(model, cache, logits[:, -1], max_new_tokens, spec, stop=eos_ids(model))
    top = rows.float().topk(2, dim=-1).values
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
        margins=(top[:, 0] - top[:, 1]).tolist(),
    )
