"""`kvstrata train-ref`: train the tiny V4.1 model and a same-size dense transformer the same way
on a synthetic associative-recall mixture, then compare their recall.

Each sequence: `pairs` key-value pairs at the start (MQAR-style), then local text (real prose from
the standard library, one token per byte), then the keys asked again in a shuffled order, each
followed by its value. The objective is the LM loss over every token plus the loss on the asked
values alone (and, for V4.1, its indexer's KL to the main attention). Recall accuracy is the share
of asked values predicted exactly; both models see the same batches in the same order.
"""

from __future__ import annotations

import inspect
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from kvstrata.models.v41 import V41Cache, V41Config, V41ForCausalLM, preset
from kvstrata_lab.bench.corpus import natural_paragraphs

KEY0, VALUE0 = 100, 300  # keys and values are drawn from their own id ranges (text ids are < 100)


@dataclass
class TrainConfig:
    preset: str = "tiny-v41"
    seq_len: int = 64
    pairs: int = 4
    vocab: int = 16  # distinct keys, and distinct values
    batch: int = 32
    steps: int = 1500
    lr: float = 1e-2
    seed: int = 0
    eval_sequences: int = 256
    #: V41Config fields to override on the preset (ablations: layer_modes, compress, ced, sliding_window)
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):

        for name in ("seq_len", "pairs", "vocab", "batch", "steps", "eval_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train-ref: {name} must be a positive whole number, got {value!r}")
        if self.pairs > self.vocab:
            raise ValueError(
                f"train-ref: pairs ({self.pairs}) must be <= vocab ({self.vocab}): keys are distinct"
            )
        if self.seq_len < 4 * self.pairs:  # the pairs (2 tokens each), text, the pairs asked again
            raise ValueError(
                f"train-ref: seq_len ({self.seq_len}) must be at least 4 x pairs ({4 * self.pairs})"
            )
        if not isinstance(self.overrides, dict):
            raise ValueError(
                "train-ref: overrides must be a mapping of V41Config fields, got "
                f"{type(self.overrides).__name__}"
            )
        known = set(inspect.signature(V41Config.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"--override: unknown V41Config fields {', '.join(unknown)} (known: "
                f"{', '.join(sorted(known))})"
            )
        try:
            preset(self.preset, **self.overrides)  # cheap: a config, no weights
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"--override: {exc}") from None


def _text_ids() -> list[int]:
    text = " ".join(natural_paragraphs(0))
    return [min(max(ord(c) - 32, 0), 94) for c in text if ord(c) < 127]


def batch(cfg: TrainConfig, rng: random.Random, text: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids `[n, seq_len]`, mask of the positions whose next token is an asked value)."""
    ids = torch.zeros(n, cfg.seq_len, dtype=torch.long)
    ask = torch.zeros(n, cfg.seq_len, dtype=torch.bool)
    fill = cfg.seq_len - 4 * cfg.pairs
    for i in range(n):
        keys = rng.sample(range(KEY0, KEY0 + cfg.vocab), cfg.pairs)
        vals = [rng.randrange(VALUE0, VALUE0 + cfg.vocab) for _ in keys]
        start = rng.randrange(len(text) - fill)
        order = rng.sample(range(cfg.pairs), cfg.pairs)
        seq = [t for kv in zip(keys, vals) for t in kv] + text[start : start + fill]
        q0 = len(seq)
        seq += [t for j in order for t in (keys[j], vals[j])]
        ids[i] = torch.tensor(seq)
        ask[i, q0 : q0 + 2 * cfg.pairs : 2] = True
    return ids, ask


def baseline_for(cfg):
    """A dense transformer of the same width, depth, heads and MLP (full causal attention)."""

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=1, head_dim=cfg.latent_dim, max_position_embeddings=4096,
            tie_word_embeddings=True, attn_implementation="sdpa",
        )
    )


def train_one(model, cfg: TrainConfig, text: list[int], label: str) -> dict:
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    model.train()
    t0, losses = time.perf_counter(), []
    for _ in tqdm(range(cfg.steps), desc=f"train {label}", unit="step"):
        ids, ask = batch(cfg, rng, text, cfg.batch)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        # the LM loss over every token, plus the asked values' loss on its own so that recall is not
        # drowned by the text (the same objective for both models)
        answer = torch.nn.functional.cross_entropy(
            out.logits[:, :-1][ask[:, :-1]].float(), ids[:, 1:][ask[:, :-1]]
        )
        loss = out.loss + answer
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return {
        "seconds": time.perf_counter() - t0, "final_loss": sum(losses[-50:]) / min(50, len(losses)),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


@torch.no_grad()
def recall(model, cfg: TrainConfig, text: list[int], dense_read: bool = False) -> float:
    """Share of asked values predicted exactly (teacher-forced, no cache, float). `dense_read`
    evaluates V4.1 as it trains (every visible global entry attended, no top-k selection)."""
    ids, ask = batch(cfg, random.Random(cfg.seed + 10_000), text, cfg.eval_sequences)
    model.train(dense_read)
    pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)
    model.eval()
    target = torch.zeros_like(ids)
    target[:, :-1] = ids[:, 1:]
    return (pred[ask] == target[ask]).float().mean().item()


@torch.no_grad()
def recall_cached(model, cfg: TrainConfig, text: list[int], n: int = 64) -> float:
    """The last asked value, answered from a V4.1 cache after a half-depth prefill (FP4 global KV,
    FP8 SWA, MXFP4 index keys): the inference path, not the training one."""
    ids, ask = batch(cfg, random.Random(cfg.seed + 10_000), text, n)
    right = 0
    for i in range(n):
        q = int(ask[i].nonzero()[-1])
        out = model(
            input_ids=ids[i : i + 1, : q + 1], past_key_values=V41Cache(model.config), logits_to_keep=1
        )
        right += int(out.logits[0, -1].argmax() == ids[i, q + 1])
    return right / n


def run(cfg: TrainConfig, out: Path) -> dict:
    torch.manual_seed(cfg.seed)
    text = _text_ids()
    mcfg = preset(cfg.preset, **cfg.overrides)
    models = {"v41": V41ForCausalLM(mcfg), "dense": baseline_for(mcfg)}
    result = {"config": asdict(cfg), "models": {}}
    for name, model in models.items():
        torch.manual_seed(cfg.seed)
        stats = train_one(model, cfg, text, name)
        stats["recall"] = recall(model, cfg, text)
        if name == "v41":
            stats["recall_dense_read"] = recall(model, cfg, text, dense_read=True)
            stats["recall_cached_fp4"] = recall_cached(model, cfg, text, n=max(4, cfg.eval_sequences // 4))
        model.save_pretrained(out / name)  # safetensors
        result["models"][name] = stats
    result["recall_gap"] = result["models"]["dense"]["recall"] - result["models"]["v41"]["recall"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_ref.json").write_text(json.dumps(result, indent=1))
    return result
