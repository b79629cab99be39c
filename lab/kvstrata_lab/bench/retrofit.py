"""`kvstrata retrofit` and `kvstrata retrofit-eval`: a model turned into the source design's causal
encoder-decoder (`kvstrata.models.ced`), fitted on the calibration families' text only, then
measured beside the original on the report families.

Calibration text: instances of the `calib` and `calib-reason` tasks (context, question and answer
as one text), never report text. Evidence: per decoder layer the projections' relative K / V
error and the attention output's relative error (original vs encoder-decoder, same rows); prefill
time of both at several lengths (alternating, median); answers on the report families, paired,
with the failures classed as retrieval or reasoning as the benchmark does. Answer rows are
appended to `answers.jsonl` as they finish, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, prefill_chunked
from kvstrata.models import load, load_model, resolve
from kvstrata.models.ced.distill import distill
from kvstrata.models.ced.fit import fit_projections, remeasure
from kvstrata.models.ced.store import check_plan, fit_summary, write
from kvstrata.models.loader import install_dir
from kvstrata_lab.bench.ced_store import store_evidence
from kvstrata_lab.bench.config import EvalConfig, RetrofitConfig
from kvstrata_lab.bench.paired import paired_delta
from kvstrata_lab.bench.protocol import greedy
from kvstrata_lab.bench.tasks import make_instance, score_answer, tag_failure


def calibration_ids(tok, length: int, count: int, first: int = 0, seed: int = 0) -> list[torch.Tensor]:
    """`count` calibration texts (`calib` and `calib-reason` in turn, from instance `first`): context,
    question and answer, `[1, <= length]` token ids each."""
    out = []
    for i in range(first, first + count):
        inst = make_instance("calib" if i % 2 == 0 else "calib-reason", tok, length, 1000 + i // 2, seed)
        q = inst.questions[0]
        text = f"{inst.context}{q.text} {q.answers[0]}"
        out.append(tok(text, return_tensors="pt").input_ids[:, :length])
    return out


def retrofit(cfg: RetrofitConfig) -> dict:
    """Fit the projections and write the encoder-decoder directory to `cfg.out`; the fit's report."""
    model, tok = load(cfg.model, cfg.dtype)
    split = check_plan(model.config, cfg.split, cfg.n_win)
    fit_ids = calibration_ids(tok, cfg.length, cfg.texts, 0, cfg.seed)
    held_ids = calibration_ids(tok, cfg.length, cfg.heldout, cfg.texts, cfg.seed)
    t0 = time.perf_counter()
    with tqdm(total=sum(i.shape[1] for i in fit_ids), desc="fit", unit="tok") as bar:
        proj, report = fit_projections(model, fit_ids, held_ids, split, cfg.ridge, progress=bar.update)
    fit_s = time.perf_counter() - t0
    ls_errors = {"key_error_ls": report.key_error, "value_error_ls": report.value_error}
    with tqdm(total=round(cfg.distill_minutes * 60), desc="distil", unit="s") as bar:
        done = distill(
            model,
            proj,
            fit_ids,
            split,
            cfg.n_win,
            cfg.distill_minutes,
            cfg.seed,
            cfg.lr,
            progress=lambda s: bar.update(max(0, min(bar.total, round(s)) - bar.n)),
        )
    if done.steps:
        remeasure(model, proj, held_ids, split, report)
    summary = {
        **fit_summary(report),
        **ls_errors,
        "n_win": cfg.n_win,
        "fit_s": round(fit_s, 1),
        "distill": asdict(done),
        "model": cfg.model,
        "dtype": cfg.dtype,
        "data": f"{cfg.texts} calib/calib-reason texts of <= {cfg.length} tokens",
    }
    source = resolve(cfg.model)
    install_dir(cfg.out, lambda tmp: write(tmp, source, model, proj, split, cfg.n_win, summary, cfg.store))
    return summary


def attention_errors(orig, ced, ids: torch.Tensor) -> list[float]:
    """Per decoder layer, ||o' - o|| / ||o|| of the attention output (`o_proj`'s input) over the rows
    the encoder-decoder's decoder runs (the last `n_win`), prefilled in one pass."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    hooks = []
    for tag, m in enumerate((orig, ced)):
        for i in range(ced.split, len(ced.inner.layers)):
            o_proj = (m.model if tag == 0 else m.inner).layers[i].self_attn.o_proj
            hooks.append(
                o_proj.register_forward_pre_hook(
                    lambda _m, a, key=(tag, i): got.__setitem__(key, a[0][0, -ced.n_win :].float())
                )
            )
    try:
        for m in (orig, ced):
            forward(m, ids, CompressedCache(m.config, "bf16"))
    finally:
        for h in hooks:
            h.remove()
    return [
        float((got[1, i] - got[0, i]).norm() / got[0, i].norm())
        for i in range(ced.split, len(ced.inner.layers))
    ]


def prefill_seconds(model, ids: torch.Tensor) -> float:
    cache = CompressedCache(model.config, "bf16")
    t0 = time.perf_counter()
    prefill_chunked(model, cache, ids)
    forward(model, ids[:, -1:], cache)  # the pass that asks for logits (the decoder's rows run here)
    return time.perf_counter() - t0


def timings(orig, ced, tok, lengths, repeats: int) -> list[dict]:
    """Prefill seconds of both models per length, alternating runs, medians (none for no lengths)."""
    if not lengths:
        return []
    text, first = torch.zeros(1, 0, dtype=torch.long), 10_000
    while text.shape[1] < max(lengths):  # calibration texts end to end (one may fall short of its length)
        text = torch.cat([text, calibration_ids(tok, max(2048, max(lengths)), 1, first)[0]], dim=1)
        first += 1
    rows = []
    for n in lengths:
        ids = text[:, :n]
        runs = {"original": [], "ced": []}
        for _ in range(repeats):
            for name, m in (("original", orig), ("ced", ced)):
                runs[name].append(prefill_seconds(m, ids))
        o, c = statistics.median(runs["original"]), statistics.median(runs["ced"])
        rows.append(
            {
                "tokens": ids.shape[1],
                "original_s": round(o, 3),
                "ced_s": round(c, 3),
                "ratio": round(c / o, 3),
            }
        )
    return rows


def answer(model, tok, inst, q) -> dict:
    cache = CompressedCache(model.config, "bf16")
    prefill_chunked(model, cache, tok(inst.context, return_tensors="pt").input_ids)
    res = greedy(model, tok, cache, q, lambda: 0.0)
    return {"output": res["output"], "score": score_answer(res["output"], q.answers)}


def _kept_prefill(out: Path) -> list[dict]:
    """The prefill rows an earlier run of this directory measured."""
    path = out / "result.json"
    return json.loads(path.read_text()).get("prefill", []) if path.exists() else []


def _prefill_rows(kept: list[dict], new: list[dict]) -> list[dict]:
    """The rows just timed, and the earlier ones at lengths not timed again, by length."""
    timed = {r["tokens"] for r in new}
    return sorted([r for r in kept if r["tokens"] not in timed] + new, key=lambda r: r["tokens"])


def evaluate(cfg: EvalConfig) -> dict:
    """The evidence for one encoder-decoder directory; rows resume from `answers.jsonl`."""
    orig, tok = load(cfg.model, cfg.dtype)
    ced = load_model(cfg.ced, cfg.dtype)
    cfg.out.mkdir(parents=True, exist_ok=True)
    fit = json.loads((Path(cfg.ced) / "ced.json").read_text())
    held = calibration_ids(tok, 2048, 1, 20_000, cfg.seed)[0]
    result = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "fit": fit,
        "attention_error": attention_errors(orig, ced, held),
        "prefill": _prefill_rows(_kept_prefill(cfg.out), timings(orig, ced, tok, cfg.timing, cfg.repeats)),
    }
    if cfg.store_method:
        text = torch.cat(calibration_ids(tok, 2048, 3, 30_000, cfg.seed), dim=1)
        n = min(text.shape[1] - 200, max(cfg.timing, default=2048))
        result["store"] = store_evidence(ced, text[:, :n], text[:, n : n + 200], cfg.store_method)
    path = cfg.out / "answers.jsonl"
    done = (
        {(r["task"], r["index"]) for r in map(json.loads, path.read_text().splitlines())}
        if path.exists()
        else set()
    )
    todo = [(t, i) for t in cfg.tasks for i in range(cfg.n) if (t, i) not in done]
    with path.open("a") as f:
        for task, index in tqdm(todo, desc="answers", unit="instance"):
            inst = make_instance(task, tok, cfg.length, index, cfg.seed)
            row = {"task": task, "index": index}
            for name, m in (("original", orig), ("ced", ced)):
                main = answer(m, tok, inst, inst.questions[0])
                probes = (
                    [answer(m, tok, inst, q)["score"] for q in inst.questions[1:]]
                    if main["score"] < 1
                    else []
                )
                row[name] = {**main, "failure": tag_failure(main["score"], probes, task)}
            f.write(json.dumps(row) + "\n")
            f.flush()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    a = {(r["task"], r["index"]): r["ced"]["score"] for r in rows}
    b = {(r["task"], r["index"]): r["original"]["score"] for r in rows}
    delta = paired_delta(a, b)
    result["answers"] = {
        "n": len(rows),
        "original": sum(b.values()),
        "ced": sum(a.values()),
        "delta": None if delta is None else asdict(delta),
        "failures": {
            name: {kind: sum(r[name]["failure"] == kind for r in rows) for kind in ("retrieval", "reasoning")}
            for name in ("original", "ced")
        },
    }
    (cfg.out / "result.json").write_text(json.dumps(result, indent=1))
    return result
