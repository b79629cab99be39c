"""The benchmark protocol: context first, question after.

The context is prefilled once (full precision, as every method prefills), with the context's last
`window` queries run with attention probabilities returned for keep policies such as SnapKV. Each
method then builds its cache from that prefill (keep policy, then encoding), the question is fed
and the answer decoded greedily reading only the method's cache.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from kvstrata.hf import CompressedCache
from kvstrata.hf.attention import stock_attention
from kvstrata.hf.probe import probing
from kvstrata.hf.run import forward, peak_rss_mb, prefill_chunked  # noqa: F401 (the bench's rows report it)
from kvstrata.hf.topk_attention import reading
from kvstrata.keep import window_rows
from kvstrata.methods import MethodSpec
from kvstrata_lab.bench.needles import PickLog, answer_spans, selected_share
from kvstrata_lab.bench.tasks import Question


@dataclass
class Prefill:
    """A prefilled context: per layer `(keys, values, seen)`, the observation window's attention per
    KV group and query row (`[b, kv_heads, window, n]`, full-attention layers), the dense cache."""

    layers: list[tuple[torch.Tensor, torch.Tensor, int]]
    scores: list[torch.Tensor | None]
    dense: DynamicCache
    tokens: int
    seconds: float
    queries: list[torch.Tensor] | None = None  # per layer, the window's queries [b, q_heads, w, d]


def prefill(model, ids: torch.Tensor, window: int = 32, chunk: int | None = None,
            progress: bool = False) -> Prefill:
    """Prefill `ids: [1, n]`; the last `window` tokens run with eager attention to expose scores.
    `chunk`: the tokens before the window are fed `chunk` at a time (None: in one pass), so a long
    context never builds its whole attention at once; `progress` shows a bar over the chunks."""
    cache = DynamicCache(config=model.config)
    n = ids.shape[1]
    w = min(window, n - 1)
    t0 = time.perf_counter()
    if chunk is None:
        forward(model, ids[:, : n - w], cache)
    else:
        starts = range(0, n - w, chunk)
        for start in tqdm(starts, desc=f"prefill {n:,}", unit="chunk", disable=not progress, leave=False):
            prefill_chunked(model, cache, ids[:, start : min(start + chunk, n - w)], chunk)
    with probing(model) as rec:
        forward(model, ids[:, n - w :], cache)
    seconds = time.perf_counter() - t0
    kv_heads = model.config.get_text_config().num_key_value_heads
    layers, scores, queries = [], [], []
    for i, layer in enumerate(cache.layers):
        seen = getattr(layer, "cumulative_length", layer.keys.shape[-2])
        layers.append((layer.keys, layer.values, seen))
        probs = rec.probs[i]
        full = not getattr(layer, "is_sliding", False)
        scores.append(window_rows(probs, kv_heads) if full and probs.shape[-1] == n else None)
        queries.append(rec.queries[i])
    return Prefill(layers, scores, cache, n, seconds, queries)


def build_cache(model, pre: Prefill, spec: MethodSpec) -> tuple[CompressedCache, float]:
    t0 = time.perf_counter()
    cache = CompressedCache(model.config, spec)
    rows = max((s.shape[-2] for s in pre.scores if s is not None), default=0)
    scores = []
    for layer, s in zip(cache.layers, pre.scores):  # each layer sums the window its own policy asks for
        keep = layer.recipe.keep
        window = getattr(keep, "window", 0) if keep is not None and keep.needs_scores else 0
        if window > rows:
            raise ValueError(f"{keep.name} scores {window} queries; the prefill probed the last {rows}")
        scores.append(None if s is None or not window else s[..., -window:, :].sum(2))
    cache.load_prefill(pre.layers, scores, pre.queries)
    return cache, time.perf_counter() - t0


def _modes(cache: CompressedCache) -> dict:
    """Depth sharing's per-head decisions, as counts (empty for other methods)."""
    modes = cache.head_modes()
    return {"head_modes": modes, "head_mode_map": cache.head_mode_map()} if modes else {}


def ask(
    model, tokenizer, pre: Prefill, spec: MethodSpec, question: Question, context: str | None = None
) -> dict:
    """Answer `question` from `spec`'s cache of the prefilled context; output text and costs. With
    the `context` text and a top-k read that keeps every token (no keep policy: cache positions are
    the context's), also `needle_selected`: per answer, the share of (decode step, full-attention
    layer, KV head) selections that held a whole occurrence of it (`kvstrata_lab.bench.needles`)."""
    cache, compress_s = build_cache(model, pre, spec)
    kv_bytes = cache.nbytes()["total"]
    trace = context is not None and not any(r.keep is not None for r in spec.recipes())
    with reading(model, cache, spec) as sparse:
        if sparse is not None and trace:
            sparse.picked = PickLog()  # every step's picks, not only the last
        res = with_costs(
            greedy(model, tokenizer, cache, question, lambda: cache.nbytes()["total"]), kv_bytes,
            compress_s, **_modes(cache),
        )
    if sparse and sparse.steps:
        # sparse reads count index rows scanned + entries gathered (full-attention layers), plus
        # what the layers that stay dense (sliding windows) hold
        res["bytes_read_per_step"] = _sparse_bytes(sparse, cache, res["dense_bytes_read_per_step"])
    if sparse is not None and trace:
        spans = answer_spans(tokenizer, context, question.answers)
        res["needle_selected"] = selected_share(sparse.picked.steps, spans)
    return res


#: the stock reference row: transformers' DynamicCache, the model's own attention, no kvstrata code
DYNAMIC = "dynamic"


def dynamic_bytes(cache: DynamicCache | StaticCache) -> int:
    """Bytes a stock cache holds (K and V of every layer, in the model's dtype; a StaticCache's
    preallocated room included)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


#: the fast stock row: transformers' StaticCache (preallocated to the context plus the question and
#: answer, written in place, no concatenation per step), the model's own attention
STATIC = "static"


def static_from(model, pre: Prefill, room: int) -> StaticCache:
    """A StaticCache sized to the context plus `room` tokens, holding the prefilled K/V."""
    cache = StaticCache(config=model.config, max_cache_len=pre.tokens + room)
    for layer, (k, v, seen) in zip(cache.layers, pre.layers):
        fill_static(layer, k, v, seen)
    return cache


def fill_static(layer, k: torch.Tensor, v: torch.Tensor, seen: int) -> None:
    """Fill an empty StaticCache layer with a prefill's `k, v` (after `seen` tokens). A sliding layer
    whose window the context passed holds the last tokens right-aligned, its length the true one: as
    the layer stands once full, so its next step rolls them into place."""
    if k.shape[-2] == seen and seen < layer.max_cache_len:
        layer.update(k, v)
        return
    if not layer.is_sliding:
        raise ValueError(f"a full-attention layer holds {k.shape[-2]} of {seen} tokens: not a prefill")
    layer.lazy_initialization(k, v)
    m = min(k.shape[-2], layer.max_cache_len)
    layer.keys[:, :, -m:] = k[:, :, -m:]
    layer.values[:, :, -m:] = v[:, :, -m:]
    layer.cumulative_length.fill_(seen)
    layer.cumulative_length_int = seen


def fill_dynamic(layer, k: torch.Tensor, v: torch.Tensor, seen: int) -> None:
    """Fill an empty DynamicCache layer with a prefill's `k, v` (after `seen` tokens; a sliding layer
    holds only its window and counts every token seen)."""
    layer.update(k, v)
    if hasattr(layer, "sliding_window"):
        layer.cumulative_length = seen


def ask_static(model, tokenizer, pre: Prefill, question: Question) -> dict:
    """Answer `question` from a StaticCache holding the prefill, attending as the model does."""
    t0 = time.perf_counter()
    room = len(tokenizer(question.text, add_special_tokens=False).input_ids) + question.max_new_tokens
    cache = static_from(model, pre, room)
    build_s, held = time.perf_counter() - t0, dynamic_bytes(cache)
    with stock_attention(model.config):
        res = greedy(model, tokenizer, cache, question, lambda: held)
    return with_costs(res, held, build_s)


def fidelity_static(model, pre: Prefill, cont_ids: torch.Tensor, ref: torch.Tensor) -> dict:
    cache = static_from(model, pre, cont_ids.shape[1])
    with stock_attention(model.config):
        return continuation(model, cache, cont_ids, ref, dynamic_bytes(cache), None)


def ask_dynamic(model, tokenizer, pre: Prefill, question: Question) -> dict:
    """Answer `question` from a copy of the prefilled DynamicCache, attending as the model does."""
    t0 = time.perf_counter()
    cache = copy.deepcopy(pre.dense)
    build_s, held = time.perf_counter() - t0, dynamic_bytes(pre.dense)
    with stock_attention(model.config):
        res = greedy(model, tokenizer, cache, question, lambda: dynamic_bytes(cache))
    return with_costs(res, held, build_s)


def fidelity_dynamic(model, pre: Prefill, cont_ids: torch.Tensor, ref: torch.Tensor) -> dict:
    with stock_attention(model.config):
        cache = copy.deepcopy(pre.dense)
        return continuation(model, cache, cont_ids, ref, dynamic_bytes(pre.dense), None)


def with_costs(res: dict, kv_bytes: float, compress_s: float | None, **extra) -> dict:
    """A `greedy` result with the cache's costs; a dense decode step reads everything held."""
    dense_read = res.pop("dense_read") or kv_bytes
    return {
        **res, "kv_bytes": kv_bytes, "compress_s": compress_s, "bytes_read_per_step": dense_read,
        "dense_bytes_read_per_step": dense_read, **extra,
    }


def greedy(
    model, tokenizer, cache, question: Question, held: Callable[[], float], position: int | None = None
) -> dict:
    """Feed `question` after the context held in `cache` and decode greedily until the answer ends.

    `held()` is what the cache holds (dense attention reads all of it each step). `position`, when
    given, is the context's length in tokens: caches that dropped entries (eviction peers) then
    still place the question at its true positions."""
    q_ids = tokenizer(question.text, add_special_tokens=False, return_tensors="pt").input_ids
    pos = None if position is None else torch.arange(position, position + q_ids.shape[1])[None]
    new: list[int] = []
    read: list[float] = []
    t0 = time.perf_counter()
    logits = forward(model, q_ids, cache, position_ids=pos)
    question_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(question.max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        new.append(nxt)
        if answer_done(tokenizer, new):
            break
        read.append(held())
        pos = None if pos is None else pos[:, -1:] + 1
        logits = forward(model, torch.tensor([[nxt]]), cache, position_ids=pos)
    decode_s = time.perf_counter() - t0
    return {
        "output": tokenizer.decode(new, skip_special_tokens=True),
        "question_s": question_s,
        "decode_s_per_token": decode_s / len(read) if read else None,
        "dense_read": sum(read) / len(read) if read else None,
    }


def _sparse_bytes(state, cache, dense_read: float) -> float:
    sparse, dense_full = state.per_step()
    return sparse + max(0.0, dense_read - dense_full)


def answer_done(tokenizer, new: list[int]) -> bool:
    """Whether greedy decoding stops after the tokens `new`: EOS, or the answer text ended (every
    engine's answer is cut by this one rule)."""
    return new[-1] == tokenizer.eos_token_id or _answer_ended(tokenizer.decode(new, skip_special_tokens=True))


def _answer_ended(text: str) -> bool:
    """Answers are one sentence: stop at a newline or a full stop once something was said."""
    body = text.strip()
    return bool(body) and ("\n" in text.lstrip() or body.endswith("."))


def reference_logits(model, pre: Prefill, cont_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits over the continuation with the uncompressed (dense fp32) cache."""
    return forward(model, cont_ids, copy.deepcopy(pre.dense), logits_to_keep=cont_ids.shape[1])[0]


def fidelity(model, pre: Prefill, spec: MethodSpec, cont_ids: torch.Tensor, ref: torch.Tensor) -> dict:
    """KL(ref || method), top-1 agreement and perplexity on a teacher-forced continuation."""
    cache, compress_s = build_cache(model, pre, spec)
    kv_bytes = cache.nbytes()["total"]
    return continuation(model, cache, cont_ids, ref, kv_bytes, compress_s, **_modes(cache))


def continuation(
    model, cache, cont_ids: torch.Tensor, ref: torch.Tensor, kv_bytes: float, compress_s: float | None,
    position_ids: torch.Tensor | None = None, **extra,
) -> dict:
    """Teacher-force the continuation over `cache` and score it against the reference logits."""
    t0 = time.perf_counter()
    got = forward(model, cont_ids, cache, logits_to_keep=cont_ids.shape[1], position_ids=position_ids)[0]
    seconds = time.perf_counter() - t0
    return {
        **fidelity_scores(ref, got, cont_ids), "kv_bytes": kv_bytes, "compress_s": compress_s,
        "question_s": seconds, "decode_s_per_token": None, "bytes_read_per_step": kv_bytes, **extra,
    }


def fidelity_scores(ref: torch.Tensor, got: torch.Tensor, cont_ids: torch.Tensor) -> dict:
    """KL(ref || got), top-1 agreement and perplexities from `[tokens, vocab]` logits over a
    teacher-forced continuation `cont_ids: [1, tokens]` (position i predicts token i+1)."""
    lp_ref = torch.log_softmax(ref[:-1].float(), -1)
    lp = torch.log_softmax(got[:-1].float(), -1)
    target = cont_ids[0, 1:]
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (lp.argmax(-1) == lp_ref.argmax(-1)).float().mean().item()
    nll = -lp.gather(-1, target[:, None]).mean().item()
    ref_nll = -lp_ref.gather(-1, target[:, None]).mean().item()
    return {
        "kl": kl, "top1": top1, "ppl": float(torch.tensor(nll).exp()),
        "ref_ppl": float(torch.tensor(ref_nll).exp()),
    }
