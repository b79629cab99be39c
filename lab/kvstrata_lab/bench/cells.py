"""The fields every row of one benchmark cell carries, and how answers, costs and a peer's failure
fill them in (shared by our rows and every peer's)."""

from __future__ import annotations

import uuid

from kvstrata.hf.run import bf16_bytes_per_token
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.needles import selection_cause
from kvstrata_lab.bench.tasks import (
    FAMILY_TASKS,
    LOOKALIKE,
    REASON_TASKS,
    REASONING,
    RETRIEVAL,
    check_fed,
    score_answer,
    tag_failure,
)

# what a row keeps of meta
ROW_META = ("hops", "text_family", "source", "question_phrasing", "lookalike", "reason_kind")


def cell_base(model, model_name: str, length: int, inst, tokens: int, prefill_s: float | None) -> dict:
    """The fields every method's row of one (model, length, task, instance) cell shares; `tokens` is
    the context as fed, refused (ValueError) unless it fits the nominal `length` (`check_fed`).
    `run` names this run of the cell: only rows of the same run are timed against each other."""
    check_fed(inst, length, tokens)
    task = inst.task
    return {
        "model": model_name, "length": length, "task": task, "index": inst.index, "context_tokens": tokens,
        "question_tokens": inst.question_tokens, "special_tokens": inst.special_tokens,
        "prefill_s": prefill_s, "run": uuid.uuid4().hex[:12],
        "kind": ("retrieval" if task in (*RETRIEVAL, *LOOKALIKE, *FAMILY_TASKS)
                 else "reasoning" if task in (*REASONING, *REASON_TASKS) else "fidelity"),
        "bf16_bytes_per_token": bf16_bytes_per_token(model.config, tokens),
        **{k: v for k, v in inst.meta.items() if k in ROW_META},
    }


def answered(row: dict, inst, answers: list[dict]) -> dict:
    """Score the answers to an instance's questions (main first, then probes) into `row`."""
    scores = [score_answer(a["output"], q.answers) for a, q in zip(answers, inst.questions)]
    main = answers[0]
    row.update(
        {
            k: main[k]
            for k in (
                "kv_bytes", "compress_s", "question_s", "decode_s_per_token", "bytes_read_per_step",
                "dense_bytes_read_per_step", "kv_bytes_in_memory", "head_modes", "head_mode_map",
            )
            if k in main
        }
    )
    row.update(
        output=main["output"], expected=list(inst.questions[0].answers), score=scores[0],
        probe_scores=scores[1:], failure=tag_failure(scores[0], scores[1:], inst.task),
    )
    if "needle_selected" in main:  # a top-k read: did its selections hold the needle?
        row["needle_selected"] = main["needle_selected"]
        row["failure_cause"] = selection_cause(
            row["failure"], main["output"], inst.questions[0].answers, main["needle_selected"]
        )
    return row


def failed(row: dict, exc: BaseException) -> dict:
    """A peer's failure on this cell: how it failed, in place of scores."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    row.update(error=f"{type(exc).__name__}: {message}"[:400], score=None, failure=None)
    return row


def costed(row: dict, tokens: int) -> dict:
    """Per-token bytes, compression against bf16 and peak memory, once `kv_bytes` is in `row`."""
    row["kv_bytes_per_token"] = row["kv_bytes"] / tokens
    row["compression"] = row["bf16_bytes_per_token"] / row["kv_bytes_per_token"]
    row["peak_rss_mb"] = protocol.peak_rss_mb()
    return row
