"""A quality measure with less noise than right / wrong: the reference answer teacher-forced after the
question, scored against bf16's cache of the same context.

Per question: the answer's log-likelihood under the method's cache minus under bf16's (nats per
answer token; paired, so most noise of the instance cancels), and per answer token the KL divergence
KL(bf16 || method) of the next-token distributions and whether both put the same token on top --
the statistics llama.cpp's `--kl-divergence` prints (mean, 99th percentile, same-top share). A
method *holds on likelihood* when its ΔLL's lower 95 % bound is ≥ `DLL_FLOOR` and its mean answer
KL ≤ `KL_CEILING` (both in `kvstrata_lab.bench.transfer`, where *holds* is decided)."""

from __future__ import annotations

import torch

from kvstrata.hf.attention import stock_attention
from kvstrata.hf.run import forward
from kvstrata.hf.topk_attention import reading
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.tasks import Question


def reference_text(question: Question) -> str:
    """The answer as it should follow the question's lead-in: its expected strings, in order."""
    return " " + ", ".join(question.answers)


def answer_logprobs(model, tokenizer, cache, question: Question,
                    position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities `[answer tokens, vocab]` of the next token at each reference-answer position,
    the question then the answer fed teacher-forced in one pass over `cache` (which it extends: pass a
    fresh one), and the answer's token ids."""
    q_ids = tokenizer(question.text, add_special_tokens=False, return_tensors="pt").input_ids
    a_ids = tokenizer(reference_text(question), add_special_tokens=False, return_tensors="pt").input_ids
    ids = torch.cat([q_ids, a_ids], 1)
    pos = None if position is None else torch.arange(position, position + ids.shape[1])[None]
    n = a_ids.shape[1]
    logits = forward(model, ids, cache, position_ids=pos, logits_to_keep=n + 1)[0]
    return torch.log_softmax(logits[:-1].float(), -1), a_ids[0]


def compare(ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The row's answer-likelihood fields: ΔLL per answer token vs the reference, per-token KL (mean,
    max, the list for percentiles across questions) and the same-top share."""
    lp_ref, target = ref
    lp, _ = got
    ll = lp.gather(-1, target[:, None]).sum().item()
    ll_ref = lp_ref.gather(-1, target[:, None]).sum().item()
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0)
    same = (lp.argmax(-1) == lp_ref.argmax(-1)).float()
    n = int(target.numel())
    return {
        "answer_tokens": n, "answer_ll": ll, "answer_ll_bf16": ll_ref, "answer_dll": (ll - ll_ref) / n,
        "answer_kl": [round(v, 6) for v in kl.tolist()], "answer_kl_mean": kl.mean().item(),
        "answer_same_top": same.mean().item(),
    }


def method_logprobs(model, tokenizer, pre, method: str, spec, question: Question):
    """`answer_logprobs` over a fresh cache of `method` built from the prefill `pre` (ours: the spec's
    `CompressedCache` read as the spec says; the stock rows: their own caches and attention)."""
    if method in (protocol.DYNAMIC, protocol.STATIC):
        room = len(tokenizer(question.text + reference_text(question), add_special_tokens=False).input_ids)
        cache = (protocol.copy.deepcopy(pre.dense) if method == protocol.DYNAMIC
                 else protocol.static_from(model, pre, room + 1))
        with stock_attention(model.config):
            return answer_logprobs(model, tokenizer, cache, question)
    cache, _ = protocol.build_cache(model, pre, spec)
    with reading(model, cache, spec):
        return answer_logprobs(model, tokenizer, cache, question)
