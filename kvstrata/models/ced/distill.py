"""Distilling the projections (only them) against the original model, within a budget of minutes.

Each calibration text is run once through the original model: its `H(split)` and the final hidden
state of its last `n_win` rows are kept (the teacher). A step then runs what the encoder-decoder
runs at the end of a prefill, with gradients: the projections make every decoder layer's K/V
from `rms(H(split))`, the decoder layers (frozen) run over the last `n_win` rows reading the
projected K/V before them and their own within, and the loss is the KL divergence of the
teacher's next-token distribution from the student's on those rows. Adam, fixed seed; steps pick
texts in a seeded order until the budget is spent.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.hf.projected import additive_mask
from kvstrata.models.ced.model import Projections, head_logits, rms, rope_tables, rotate


@dataclass
class DistillReport:
    minutes: float  # the budget
    seed: int
    lr: float
    steps: int = 0
    seconds: float = 0.0
    loss_first: float | None = None  # mean KL over the first tenth of the steps
    loss_last: float | None = None  # and over the last tenth


class _Splice:
    """What a decoder layer's attention calls `update` on while training: the projected K/V of the
    positions before the window (with gradients), then the layer's own K/V of the window."""

    def __init__(self):
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        pk, pv = self.before[layer_idx]
        return torch.cat([pk, k], dim=-2), torch.cat([pv, v], dim=-2)


def teacher(model, ids: torch.Tensor, split: int, n_win: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`H(split)`: `[1, n, hidden]`, final hidden state of the last `n_win` rows) of the original."""
    got = []
    hook = model.model.layers[split].register_forward_pre_hook(lambda _m, a: got.append(a[0]))
    try:
        with torch.inference_mode():
            out = model.model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return got[0].clone(), out.last_hidden_state[:, -n_win:].clone()


def student_logits(
    model, proj: Projections, h: torch.Tensor, split: int, n_win: int, types: list[str], typed: bool
) -> torch.Tensor:
    """Logits of the last `n_win` rows as the encoder-decoder computes them from `h = H(split)`."""
    n = h.shape[1]
    q0 = n - n_win
    x = rms(h).float()  # the projections train in float32 whatever the model's dtype
    pos = torch.arange(n).unsqueeze(0)
    splice = _Splice()
    text = model.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    t = torch.arange(q0, n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    kinds = set(types[split:])
    ropes, masks = rope_tables(model.model.rotary_emb, h, pos, kinds, typed), {}
    for kind in kinds:
        seen = j <= t
        if kind == "sliding_attention" and window:
            seen &= (t - j) < window
        masks[kind] = additive_mask(seen, h.dtype)
    for idx, i in enumerate(range(split, len(model.model.layers))):
        k, v = proj(x, idx)
        cos, sin = ropes[types[i]]
        k, v = k.to(h.dtype), v.to(h.dtype)
        splice.before[i] = (rotate(k, cos, sin)[..., :q0, :], v[..., :q0, :])
    y = h[:, q0:]
    for i in range(split, len(model.model.layers)):
        cos, sin = ropes[types[i]]
        y = model.model.layers[i](
            y,
            attention_mask=masks[types[i]],
            position_embeddings=(cos[:, q0:], sin[:, q0:]),
            position_ids=pos[:, q0:],
            cache=splice,
        )
    return head_logits(model, model.model.norm(y))


def distill(
    model,
    proj: Projections,
    texts: list[torch.Tensor],
    split: int,
    n_win: int,
    minutes: float,
    seed: int = 0,
    lr: float = 1e-4,
    progress: Callable[[float], None] | None = None,
    max_steps: int | None = None,
) -> DistillReport:
    """Train `proj` in place for `minutes` of this machine (or `max_steps`, whichever ends first);
    `progress(seconds)` after each step."""
    report = DistillReport(minutes, seed, lr)
    texts = [ids for ids in texts if ids.shape[1] > n_win]
    if not texts or minutes <= 0:
        return report
    typed = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
    text = model.config.get_text_config(decoder=True)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    teachers = [teacher(model, ids, split, n_win) for ids in texts]
    torch.manual_seed(seed)
    order = random.Random(seed)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    proj.float().train()
    opt = torch.optim.Adam(proj.parameters(), lr=lr)
    losses: list[float] = []
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < minutes * 60 and (max_steps is None or len(losses) < max_steps):
            h, target = teachers[order.randrange(len(teachers))]
            with torch.enable_grad():
                s = student_logits(model, proj, h, split, n_win, types, typed).float()
                with torch.no_grad():
                    want = F.log_softmax(head_logits(model, target).float(), dim=-1)
                # nats per row: the rows are the batch
                loss = F.kl_div(
                    F.log_softmax(s, dim=-1).flatten(0, 1),
                    want.flatten(0, 1),
                    log_target=True,
                    reduction="batchmean",
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(time.perf_counter() - t0)
    finally:
        for p in frozen:
            p.requires_grad_(True)
        proj.eval()
    report.steps, report.seconds = len(losses), round(time.perf_counter() - t0, 1)
    tenth = max(1, len(losses) // 10)
    report.loss_first = sum(losses[:tenth]) / tenth
    report.loss_last = sum(losses[-tenth:]) / tenth
    return report
