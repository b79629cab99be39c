"""CSA2's pieces as small functions: RoPE, m-token compression, causal visibility, lightning
scores, top-k / hierarchical / re-scored selection, and SWA + sparse-global attention.

Shapes: `B` batch, `T` queries, `S` global entries, `H` query heads, `D` latent channels.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

NEG = float("-inf")


def rope(x: torch.Tensor, pos: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Interleaved RoPE on the trailing `dim` channels of `x: [B, T, D]` or `[B, H, T, D]`
    (V4's layout, through transformers' DeepSeek-V4 helper); `pos: [T]`."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = pos.float()[:, None] * freqs  # [T, dim/2]
    cos, sin = ang.cos()[None], ang.sin()[None]
    if x.dim() == 3:
        return apply_rotary_pos_emb(x[:, None], cos, sin).squeeze(1)
    return apply_rotary_pos_emb(x, cos, sin)


def compress(kv: torch.Tensor, gate: torch.Tensor | None, m: int) -> torch.Tensor:
    """m = 1: the projections as they are; m = 2: per channel, a softmax over each pair of
    positions of the gate weights the pair's projections. `kv: [B, T, C]` with T a multiple of m."""
    if m == 1:
        return kv
    b, t, c = kv.shape
    if t % m:
        raise ValueError(f"compress: {t} positions is not a multiple of m={m}")
    w = gate.view(b, t // m, m, c).float().softmax(dim=2).to(kv.dtype)
    return (w * kv.view(b, t // m, m, c)).sum(2)


def visible(q_pos: torch.Tensor, m: int) -> torch.Tensor:
    """Entries query t may read: entry j iff j < floor((t + 1) / m). `q_pos: [T]` -> counts `[T]`."""
    return torch.div(q_pos + 1, m, rounding_mode="floor")


def causal_scores(scores: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Scores `[B, T, S]` with every entry a query may not read set to -inf."""
    s = scores.shape[-1]
    return scores.masked_fill(torch.arange(s)[None, None] >= vis[None, :, None], NEG)


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k entry indices per query from causal scores `[B, T, S]`; -1 marks an empty slot
    (a query that sees fewer than k entries)."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return scores.new_zeros(*scores.shape[:2], 0, dtype=torch.long)
    val, idx = scores.topk(k, dim=-1)
    return idx.masked_fill(val == NEG, -1)


def hierarchical(
    scores: torch.Tensor, vis: torch.Tensor, k: int, block: int, blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-first selection: max-pool causal scores over blocks of `block` entries, always keep
    each query's newest visible block, take the top `blocks` blocks, then the top-k entries inside.
    Returns (indices `[B, T, k]`, candidates `[B, T, blocks * block]`), -1 for empty slots."""
    b, t, s = scores.shape
    nb = -(-s // block)
    padded = torch.full((b, t, nb * block), NEG, dtype=scores.dtype)
    padded[..., :s] = scores
    pooled = padded.view(b, t, nb, block).amax(-1)
    newest = torch.div(vis - 1, block, rounding_mode="floor")  # [T]; -1 when nothing is visible
    has = newest >= 0
    pooled[:, has, newest[has]] = float("inf")
    kb = min(blocks, nb)
    bval, bidx = pooled.topk(kb, dim=-1)  # [B, T, kb]
    cand = (bidx[..., None] * block + torch.arange(block)).view(b, t, kb * block)
    ok = (bval != NEG)[..., None].expand(b, t, kb, block).reshape(b, t, -1) & (cand < vis[None, :, None])
    cand = cand.masked_fill(~ok, -1)
    return rescore(scores, cand, k), cand


def rescore(scores: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k among candidate entries `cand: [B, T, C]` (-1 = none) by `scores: [B, T, S]`."""
    if cand.shape[-1] == 0 or scores.shape[-1] == 0:
        return cand.new_full((*cand.shape[:2], 0), -1)
    vals = scores.gather(-1, cand.clamp(min=0)).masked_fill(cand < 0, NEG)
    k = min(k, cand.shape[-1])
    v, j = vals.topk(k, dim=-1)
    return cand.gather(-1, j).masked_fill(v == NEG, -1)


def attend(
    q: torch.Tensor, q_pos: torch.Tensor, swa: torch.Tensor, swa_pos0: int, window: int,
    latents: torch.Tensor | None, idx: torch.Tensor | None, sinks: torch.Tensor | None = None,
    swa_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """One softmax over each query's SWA window (keys = values, `swa: [B, P, D]` holding positions
    `swa_pos0 …`; query t reads positions `[max(swa_pos0, t - window + 1), t]`), its selected
    global entries (`latents: [B, S, D]`, K = V; `idx: [B, T, k]`, -1 unread) and, with `sinks: [H]`,
    one learned per-head logit that takes probability mass and adds nothing (V4's attention sink:
    a head may attend to nothing). `swa_v` (same layout as `swa`): values held apart from the SWA keys.
    `q: [B, H, T, D]` -> `[B, H, T, D]`."""
    b, h, t, d = q.shape
    scale = d**-0.5
    offs = torch.arange(window) - window + 1
    wpos = q_pos[:, None] + offs[None, :]  # [T, W] positions each query's window covers
    wok = (wpos >= swa_pos0) & (wpos >= 0)
    wi = (wpos - swa_pos0).clamp(min=0, max=max(swa.shape[1] - 1, 0))
    wk = swa[:, wi]  # [B, T, W, D]
    logits = torch.einsum("bhtd,btwd->bhtw", q.float(), wk.float()) * scale
    logits = logits.masked_fill(~wok[None, None], NEG)
    vals = [wk if swa_v is None else swa_v[:, wi]]
    if latents is not None and idx is not None and idx.shape[-1] and latents.shape[1]:
        gk = latents[torch.arange(b)[:, None, None], idx.clamp(min=0)]  # [B, T, k, D]
        gl = torch.einsum("bhtd,btkd->bhtk", q.float(), gk.float()) * scale
        logits = torch.cat([logits, gl.masked_fill((idx < 0)[:, None], NEG)], dim=-1)
        vals.append(gk)
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(b, h, t, 1)
        p = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = logits.softmax(-1)
    v = torch.cat(vals, dim=2).float()  # [B, T, W + k, D]
    return torch.einsum("bhtn,btnd->bhtd", p, v).to(q.dtype)


def index_loss(q: torch.Tensor, latents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """KL from the main attention over every visible global entry (heads summed, no gradient) to
    the indexer's softmax over the same entries: how a top-k indexer learns what to select.
    `q: [B, H, T, D]`, `latents: [B, S, D]`, causal `scores: [B, T, S]`."""
    ok = scores != NEG
    rows = ok.any(-1)
    if not rows.any():
        return scores.new_zeros(())
    with torch.no_grad():
        main = torch.einsum("bhtd,bsd->bhts", q.float(), latents.float()) * q.shape[-1] ** -0.5
        target = main.masked_fill(~ok[:, None], NEG).softmax(-1).nan_to_num(0.0).mean(1)  # [B, T, S]
    logp = scores.masked_fill(~ok, -1e9).log_softmax(-1)
    kl = (target * (target.clamp(min=1e-12).log() - logp)).masked_fill(~ok, 0.0).sum(-1)
    return kl[rows].mean()
