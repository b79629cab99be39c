"""`kvstrata sparse-recall`: does a top-k read select what attention needs, and the needle?

A top-k read's only error is what its selection leaves out. On needle prompts from the benchmark's
own generator (`kvstrata_lab.bench.tasks.make_instance`), with the answer teacher-forced after the
question, each query that predicts an answer token is run as a decode step runs it: for every
full-attention layer (sliding-window layers read densely and are left out) kvstrata's own
`kvstrata.read.sparse.select` picks the positions (sinks + recent window + the indexer's top-k, by
the layer's Full / Reindex / Reuse mode, the lowrank basis fitted at the first step), over the keys
rounded to bf16 as a `bf16` store holds them. Against the true softmax attention (the model's own
eager probabilities, averaged over the query heads of each KV head) it measures per KV head:
- recall@k: the indexer's top-k against the true top-k over the same candidates (sinks and window
  excluded), |intersection| / k;
- mass: the true attention mass the whole selection captures (1 - mass is what the read drops);
- needle: whether a whole occurrence of the answer is in the selection, and in the true top set
  of the same size (`kvstrata_lab.bench.needles`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvstrata.hf.cache import head_dim, layer_classes
from kvstrata.methods import parse_method
from kvstrata.models import load
from kvstrata.read.sparse import ReadState, TopK, select
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.config import DEFAULT_METHOD, RecallConfig  # noqa: F401 (its settings)
from kvstrata_lab.bench.needles import Span, answer_spans, holds_all
from kvstrata_lab.bench.sparse_recall_plot import plot_positions, plot_recall
from kvstrata_lab.bench.tasks import make_instance

RESERVE = 8  # tokens kept free for the teacher-forced answer, so prompt + answer fit the nominal length


@dataclass
class NeedlePrompt:
    """A task instance fed as context + question + answer (all but its last token): the last
    `queries` positions each predict an answer token; `spans[a]`: answer a's occurrences."""

    uid: str
    ids: torch.Tensor
    queries: int
    spans: list[list[Span]]
    depths: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Rows:
    """bf16 K and V rows (what `ReadState` counts bytes with; the counts are not used here)."""

    dim: int

    def row_bytes(self) -> tuple[float, float]:
        return 2.0 * self.dim, 2.0 * self.dim


def read_config(method: str) -> TopK:
    """The spec's top-k read; refused unless the spec is that read over a plain `bf16` store (the
    measurement is the selection alone: no keep policy, depth sharing or codec error mixed in)."""
    spec = parse_method(method)
    cfg = spec.full.read
    plain = all(r.keep is None and r.depth is None and r.codec.name == "bf16" and not r.transforms
                for r in spec.recipes())
    if cfg is None or not plain:
        raise ValueError(f"--method: expected a top-k read over the bf16 store (e.g. {DEFAULT_METHOD!r}), "
                         f"got {method!r}")
    return cfg


def needle_prompt(tok, task: str, length: int, index: int, seed: int = 0, haystack: str = "noise"
                  ) -> NeedlePrompt:
    """Instance `index` of `task` built `RESERVE` tokens short of `length`, its answer appended."""
    inst = make_instance(task, tok, length - RESERVE, index, seed, haystack)
    question = inst.questions[0]
    answer = tok(" " + " ".join(question.answers), add_special_tokens=False).input_ids[: RESERVE + 1]
    ids = (tok(inst.context).input_ids + tok(question.text, add_special_tokens=False).input_ids
           + answer[:-1])
    return NeedlePrompt(inst.uid, torch.tensor([ids]), len(answer),
                        answer_spans(tok, inst.context, question.answers), inst.meta.get("depths", []))


def full_layers(config) -> list[int]:
    return [i for i, (cls, _) in enumerate(layer_classes(config)) if cls == "full"]


def measure(model, prompt: NeedlePrompt, cfg: TopK, chunk: int | None = None, progress: bool = False
            ) -> tuple[list[dict], dict]:
    """One record per (query, full-attention layer, KV head), and the last query's trace (true
    attention, selection and needle per layer) for the positions plot."""
    pre = protocol.prefill(model, prompt.ids, window=prompt.queries, chunk=chunk, progress=progress)
    text = model.config.get_text_config(decoder=True)
    layers = full_layers(model.config)
    state = ReadState(cfg=cfg, modes=dict(zip(layers, cfg.modes(len(layers)))),
                      layers=[_Rows(head_dim(text))] * text.num_hidden_layers, head_dim=head_dim(text))
    keys = {i: pre.layers[i][0].to(torch.bfloat16).float() for i in layers}  # as a bf16 store holds them
    w, n = prompt.queries, pre.tokens
    records, trace = [], {}
    for t in range(w):  # one decode step per query, its layers in order (Reuse needs its Full layer)
        seen = n - w + t + 1  # causal: keys this query sees, itself included
        for i in layers:
            idx = select(state, i, pre.queries[i][:, :, t : t + 1], keys[i][..., :seen, :])
            attn = pre.scores[i][:, :, t, :seen]  # [b, kv_heads, seen], rows sum to 1
            records += _scores(cfg, idx, attn, prompt.spans, seen, t, i, state.modes[i])
            if t == w - 1:
                trace[i] = {"attn": attn[0, 0], "picked": idx[0, 0]}
    return records, trace


def _scores(cfg: TopK, idx: torch.Tensor, attn: torch.Tensor, spans: list[list[Span]], seen: int,
            query: int, layer: int, mode: str) -> list[dict]:
    """The per-head numbers of one layer's selection `idx: [1, h, m]` against `attn: [1, h, seen]`."""
    sinks = min(cfg.sinks, seen)  # select's candidates: between the sinks and the recent window
    recent = max(sinks, seen - cfg.window)
    k = min(cfg.k, recent - sinks)
    inside = (idx >= sinks) & (idx < recent)
    top = idx[inside].reshape(*idx.shape[:-1], -1)  # the indexer's top-k (every head has as many)
    true = attn[..., sinks:recent].topk(k, -1).indices + sinks
    hits = (top[..., :, None] == true[..., None, :]).any(-1).sum(-1)
    recall = hits / k if k else torch.ones(idx.shape[:-1])  # nothing left out: all of it is read
    mass = attn.gather(-1, idx).sum(-1)
    hit = holds_all(idx, spans)
    true_hit = holds_all(attn.topk(idx.shape[-1], -1).indices, spans)
    needle = torch.tensor(sorted({p for a in spans for s in a for p in s}), dtype=torch.long)
    needle_attn = attn[..., needle[needle < seen]].sum(-1)
    return [
        {"query": query, "layer": layer, "mode": mode, "head": h, "tokens": seen, "k": k,
         "recall": recall[0, h].item(), "mass": min(1.0, mass[0, h].item()),
         "needle_selected": bool(hit[0, h]),
         "needle_in_true_top": bool(true_hit[0, h]), "needle_attention": needle_attn[0, h].item()}
        for h in range(idx.shape[1])
    ]


def summarise(records: list[dict]) -> list[dict]:
    """Per (length, layer): mean / min recall and mass, needle-hit rates, over prompts, queries, heads."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["length"], r["layer"], r["mode"]), []).append(r)
    out = []
    for (length, layer, mode), rs in sorted(groups.items()):
        def mean(key):
            return sum(float(r[key]) for r in rs) / len(rs)

        out.append({
            "length": length, "layer": layer, "mode": mode, "n": len(rs),
            "recall_mean": mean("recall"), "recall_min": min(r["recall"] for r in rs),
            "mass_mean": mean("mass"), "mass_min": min(r["mass"] for r in rs),
            "needle_selected": mean("needle_selected"), "needle_in_true_top": mean("needle_in_true_top"),
            "needle_attention": mean("needle_attention"),
        })
    return out


def markdown(cfg: RecallConfig, command: str, summary: list[dict], seconds: dict[int, float]) -> str:
    lines = [
        f"# Sparse selection recall: `{cfg.method}` on {cfg.model}\n",
        f"```bash\n{command}\n```\n",
        f"{cfg.prompts} `{cfg.task}` prompt(s) per length (the benchmark's generator, seed {cfg.seed}, "
        f"{cfg.haystack} haystack), the answer teacher-forced; every query that predicts an answer token "
        "is a decode step. Per full-attention layer (sliding layers read densely), over prompts × "
        "queries × KV heads: recall@k of the indexer's top-k against the true attention's top-k over "
        "the same candidates; the true attention mass the whole selection (sinks + window + top-k) "
        "captures; how often a whole occurrence of the answer is in the selection, and in the true "
        "top set of the same size; the true attention on the answer's tokens.\n",
        "| length | layer (mode) | n | recall mean | recall min | mass mean | mass min | needle in "
        "selection | needle in true top | attention on needle | s (length) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['length']:,} | {r['layer']} ({r['mode']}) | {r['n']} | {r['recall_mean']:.3f} | "
            f"{r['recall_min']:.3f} | {r['mass_mean']:.3f} | {r['mass_min']:.3f} | "
            f"{r['needle_selected']:.0%} | {r['needle_in_true_top']:.0%} | {r['needle_attention']:.3f} | "
            f"{seconds.get(r['length'], 0):.0f} |"
        )
    return "\n".join(lines) + "\n"


def run(cfg: RecallConfig, out: Path, command: str = "", load_model=None) -> dict:
    """Measure every length and prompt; writes sparse_recall.json / .md / .png into `out`."""
    topk = read_config(cfg.method)
    model, tok = (load_model or load)(cfg.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        records, seconds, prompts, trace = _measure_all(model, tok, topk, cfg)
    finally:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(records)
    result = {"config": asdict(cfg), "command": command, "seconds": seconds, "summary": summary,
              "prompts": prompts, "records": records}
    (out / "sparse_recall.json").write_text(json.dumps(result, indent=1))
    (out / "sparse_recall.md").write_text(markdown(cfg, command, summary, seconds))
    plot_recall(records, summary, cfg, out / "sparse_recall.png")
    if trace is not None:
        plot_positions(*trace, cfg, out / "sparse_recall_positions.png")
    return result


def _measure_all(model, tok, topk: TopK, cfg: RecallConfig) -> tuple[list[dict], dict, list[dict], tuple]:
    """(records, seconds per length, the prompts' needles, the longest length's first trace)."""
    records, seconds, prompts, trace = [], {}, [], None
    bar = tqdm(total=len(cfg.lengths) * cfg.prompts, desc="sparse-recall", unit="prompt")
    for length in cfg.lengths:
        t0 = time.perf_counter()
        for index in range(cfg.prompts):
            bar.set_postfix_str(f"{length:,} #{index}")
            prompt = needle_prompt(tok, cfg.task, length, index, cfg.seed, cfg.haystack)
            got, trace_now = measure(model, prompt, topk, cfg.chunk, progress=True)
            records += [dict(r, length=length, prompt=prompt.uid) for r in got]
            prompts.append({"length": length, "uid": prompt.uid, "tokens": prompt.ids.shape[1],
                            "queries": prompt.queries, "needle_spans": prompt.spans, "depths": prompt.depths})
            trace = (length, prompt, trace_now) if index == 0 else trace
            bar.update(1)
        seconds[length] = time.perf_counter() - t0
        tqdm.write(f"{length:,} tokens: {seconds[length]:.0f} s for {cfg.prompts} prompt(s)")
    bar.close()
    return records, seconds, prompts, trace
