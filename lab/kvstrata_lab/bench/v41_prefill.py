"""`kvstrata v41-prefill`: half-depth (CED) prefill time against the same-size model without CED.

Both models share every weight; the non-CED one projects decoder global KV from each layer's own
input and so must run every layer over every prompt token. Runs alternate between the two so that
machine noise hits both; the ratio of medians is the number.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kvstrata.models.v41 import V41Cache, V41ForCausalLM, preset
from kvstrata_lab.bench.results import ReportInput


def _timed(model, ids) -> float:
    cache = V41Cache(model.config)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(ids, past_key_values=cache, logits_to_keep=1)
    return time.perf_counter() - t0


def run(name: str = "small-v41", factor: int = 16, repeats: int = 5, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    ced = V41ForCausalLM(preset(name)).eval()
    plain = V41ForCausalLM(preset(name, ced=False)).eval()
    plain.load_state_dict(ced.state_dict())
    cfg = ced.config
    tokens = factor * cfg.n_win
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    _timed(ced, ids[:, : cfg.n_win * 2]), _timed(plain, ids[:, : cfg.n_win * 2])  # warm-up
    t_ced, t_plain = [], []
    for _ in range(repeats):
        t_ced.append(_timed(ced, ids))
        t_plain.append(_timed(plain, ids))
    a, b = statistics.median(t_ced), statistics.median(t_plain)
    return {"preset": name, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "n_win": cfg.n_win,
            "sliding_window": cfg.sliding_window, "prompt_tokens": tokens, "repeats": repeats,
            "threads": torch.get_num_threads(), "ced_prefill_s": a, "full_depth_prefill_s": b, "ratio": a / b,
            "ced_runs_s": t_ced, "full_depth_runs_s": t_plain}


def _override(c: dict) -> str:
    return f" --override '{json.dumps(c['overrides'])}'" if c.get("overrides") else ""


def _f3(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def _train_lines(path, r: dict) -> list[str]:
    c, v, d = r["config"], r["models"]["v41"], r["models"]["dense"]
    what = (f"with `V41Config` overrides {', '.join(sorted(c['overrides']))}" if c.get("overrides")
            else "as published (scaled by depth)")
    return [f"Associative recall after training both `{c['preset']}`-sized models the same way, V4.1's "
            f"layout {what} ({c['steps']} steps, batch {c['batch']}, {c['seq_len']} tokens, {c['pairs']} "
            f"pairs over {c['vocab']} keys/values; chance {1 / c['vocab']:.3f}; `kvstrata train-ref "
            f"--preset {c['preset']} --steps {c['steps']}{_override(c)} --out "
            f"DIR/v41/{path.parent.name}`):\n",
            "| model | parameters | recall (teacher-forced, top-k reads) | recall, every global entry read "
            "(as trained) | recall from FP4 cache, half-depth prefill | final loss (V4.1: + indexer KL) | "
            "train s |",
            "|---|---|---|---|---|---|---|",
            f"| V4.1 (CSA2 + CED) | {v['parameters']:,} | {v['recall']:.3f} | "
            f"{_f3(v.get('recall_dense_read'))} | {_f3(v.get('recall_cached_fp4'))} | {v['final_loss']:.3f} "
            f"| {v['seconds']:.0f} |",
            f"| dense transformer | {d['parameters']:,} | {d['recall']:.3f} | – | – | {d['final_loss']:.3f} "
            f"| {d['seconds']:.0f} |", ""]


def report_section(given: ReportInput) -> str:
    """The report's V4.1 section from `out/v41/prefill.json` and every `out/v41/*/train_ref.json`
    (`train-ref` first; '' when none was run into this directory)."""
    out = given.out
    pre = Path(out) / "v41" / "prefill.json"
    runs = sorted((Path(out) / "v41").glob("*/train_ref.json"),
                  key=lambda p: (p.parent.name != "train-ref", p.parent.name))
    lines = []
    if pre.exists():
        r = json.loads(pre.read_text())
        lines += [f"Half-depth (CED) prefill of {r['prompt_tokens']} tokens (16 x n_win = {r['n_win']}) on "
                  f"`{r['preset']}` ({r['layers']} layers): {r['ced_prefill_s']:.3f} s against "
                  f"{r['full_depth_prefill_s']:.3f} s for the same weights without CED, ratio "
                  f"**{r['ratio']:.3f}** (median of {r['repeats']}; `kvstrata v41-prefill --preset "
                  "small-v41 --factor 16 --out DIR/v41/prefill.json`).\n"]
    for path in runs:
        lines += _train_lines(path, json.loads(path.read_text()))
    return "\n".join(["## V4.1 reference model\n", *lines]) if lines else ""
