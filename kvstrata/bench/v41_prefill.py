"""`kvstrata v41-prefill`: half-depth (CED) prefill time against the same-size model without CED.

Both models share every weight; the non-CED one projects decoder global KV from each layer's own
input and so must run every layer over every prompt token. Runs alternate between the two so that
machine noise hits both; the ratio of medians is the number.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvstrata.models.v41 import V41Cache, V41ForCausalLM, preset


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
