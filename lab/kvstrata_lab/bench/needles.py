"""Where a task's needle lives in the tokens a model is fed, and whether a top-k read selected it.

A needle is read through its answer's tokens (the pass key's digits): an occurrence of the answer
is held by a selection when every one of its tokens is among the positions read. A top-k decode
step's picks (`kvstrata.read.sparse.ReadState.picked`) are kept step by step by `PickLog`, so the
benchmark can tell, for a failed question, whether the selection ever held the needle: when it
never did, the failure is tagged `SELECTION_MISSED` (what the sparse read, not the model, lost).
"""

from __future__ import annotations

import torch

#: the benchmark's tag for a retrieval failure whose needle no top-k selection held
SELECTION_MISSED = "selection missed the needle"

Span = list[int]  # token positions of one occurrence of an answer


def answer_spans(tokenizer, context: str, answers) -> list[list[Span]]:
    """Per answer, the token positions of each place its text occurs in `context` as the model is
    fed it (special tokens included, so positions are cache positions)."""
    offsets = tokenizer(context, return_offsets_mapping=True)["offset_mapping"]
    out = []
    for answer in answers:
        spans, start = [], context.find(answer) if answer else -1
        while start >= 0:
            end = start + len(answer)
            spans.append([i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start])
            start = context.find(answer, start + 1)
        out.append(spans)
    return out


def holds(picks: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """Per row of `picks: [..., m]` (positions read), whether some occurrence in `spans` is whole
    among them: `[...]` bool (all False when the answer is nowhere in the context)."""
    held = torch.zeros(picks.shape[:-1], dtype=torch.bool)
    for span in spans:
        pos = torch.tensor(span, dtype=picks.dtype)
        held |= (picks[..., :, None] == pos).any(-2).all(-1)
    return held


def holds_all(picks: torch.Tensor, answers: list[list[Span]]) -> torch.Tensor:
    """Whether every answer has an occurrence held by each row of `picks`."""
    held = torch.ones(picks.shape[:-1], dtype=torch.bool)
    for spans in answers:
        held &= holds(picks, spans)
    return held


class PickLog(dict):
    """A `ReadState.picked` that also keeps every call's picks, `(layer, positions [b, h, m])` in
    call order: the read stratum keeps only each layer's last step, a trace needs all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, torch.Tensor]] = []

    def __setitem__(self, layer: int, idx: torch.Tensor) -> None:
        super().__setitem__(layer, idx)
        self.steps.append((layer, idx))


def selected_share(steps: list[tuple[int, torch.Tensor]], answers: list[list[Span]]) -> list[float] | None:
    """Per answer, the share of (decode step, layer, KV head) selections that held an occurrence of
    it; None when no sparse step ran (an answer ended at its first, densely read, token)."""
    if not steps:
        return None
    return [torch.cat([holds(idx, spans).flatten() for _, idx in steps]).float().mean().item()
            for spans in answers]


def selection_cause(failure: str | None, output: str, answers, shares: list[float] | None) -> str | None:
    """`SELECTION_MISSED` for a retrieval failure when an answer the output lacks was held by no
    selection of any layer and head at any decode step; else None (the model, or something
    the selection did hold, failed)."""
    if failure != "retrieval" or shares is None:
        return None
    missed = [a for a, share in zip(answers, shares) if a not in output and share == 0.0]
    return SELECTION_MISSED if missed else None
