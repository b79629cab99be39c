"""`kvstrata replay-check`: how far each way of serving a cached prefix answers from a cold run, and
what each costs.

Random prompts (natural text at several seeds) are cut at random split points: the turn before
ended there, so the store holds its whole blocks and the SWA state at its last one, and the next
turn adds `turn_tokens` tokens. That next turn is served cold (an empty store: a full prefill), as
a hit (global KV and SWA state installed) and, with the SWA state gone, as a bounded replay of
1 / 2 / 4 sliding windows and as an exact replay (the receptive field of the sliding windows,
`exact_replay_tokens`). From every served cache N
decode steps are fed the cold run's greedy tokens, so each step's next-token distribution is
compared with the cold run's on the same history: KL, and whether its greedy token is the cold
run's (all N agree: the same greedy answer). TTFT of each mode is set against the hit's and the
cold run's of the same prompt, measured in the same run.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstrata.hf.cache import layer_classes
from kvstrata.hf.run import decode_steps
from kvstrata.models import load
from kvstrata.names import ServeKind
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_keys import model_fingerprint
from kvstrata.place.prefix_server import EXACT, PrefixServer, ReplayTokens, replay_window, weights_digest
from kvstrata.place.store import KVStore
from kvstrata_lab.bench.corpus import natural_ids
from kvstrata_lab.bench.store_evidence import BLOCK, kl_rows

RESULTS = "replay_check"  # OUT/replay_check.json and .md


@dataclass(frozen=True)
class ReplayCheckConfig:
    """One run: the model and method, how many prompts and split points, their sizes."""

    model: str
    method: str = "bf16"
    prompts: int = 3
    tokens: int = 2048  # each prompt's text; the turn before ends in (block, tokens - turn_tokens]
    splits: int = 2  # split points per prompt
    turn_tokens: int = 64  # tokens the next turn adds after the split
    new_tokens: int = 16  # decode steps compared after each served prompt
    windows: tuple[int, ...] = (1, 2, 4)  # bounded replays, in sliding windows
    block: int = BLOCK
    seed: int = 0

    def command(self, out: str) -> str:
        """The `kvstrata` command line that runs this."""
        return (f"kvstrata replay-check --model {self.model} --method '{self.method}' "
                f"--prompts {self.prompts} --tokens {self.tokens} --splits {self.splits} "
                f"--turn-tokens {self.turn_tokens} --new-tokens {self.new_tokens} "
                f"--windows {','.join(map(str, self.windows))} --block {self.block} --seed {self.seed} "
                f"--out {out}")


class ReadOnlyStore:
    """A store that serves what it holds and keeps nothing new: every mode finds the same records."""

    def __init__(self, store: KVStore):
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def put_global(self, *args, **kwargs) -> bool:
        return False

    def put_swa(self, *args, **kwargs) -> bool:
        return False


def memory_store() -> KVStore:
    return KVStore(MemoryTier(1 << 36), MemoryTier(1 << 34))


def modes(classes: list, windows: tuple[int, ...]) -> dict[str, ReplayTokens]:
    """Mode name -> the server's `n_win` ("hit" needs none); only a hit without sliding layers."""
    window = max((w for c, w in classes if c == "sliding"), default=0)
    if not window:
        return {"hit": None}
    return {"hit": None, **{f"bounded {w}w": w * window for w in windows}, "exact": EXACT}


def split_points(rng: random.Random, cfg: ReplayCheckConfig) -> list[int]:
    """Where the turn before ended: at least one whole block (plus the token kept back) stored."""
    return sorted(rng.randint(cfg.block + 1, cfg.tokens - cfg.turn_tokens) for _ in range(cfg.splits))


def _log_probs(rows: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(rows.double(), -1)


def check_split(model, fingerprint: str, cfg: ReplayCheckConfig, ids: list[int], split: int) -> list[dict]:
    """The turn after `split` served each way: per mode the served kind, tokens reused and replayed,
    per-step KL and greedy agreement against the cold run, TTFT against the hit's and the cold run's."""
    server = lambda store, n_win=None: PrefixServer(  # noqa: E731
        model, store, cfg.method, block_size=cfg.block, n_win=n_win, fingerprint=fingerprint)
    prompt = ids[:split + cfg.turn_tokens]
    cold = server(ReadOnlyStore(memory_store())).serve(prompt)
    ref_tokens, ref_rows = decode_steps(model, cold.cache, cold.logits, cfg.new_tokens, cfg.method)
    ref = _log_probs(ref_rows)
    store = memory_store()
    server(store).serve(ids[:split])  # the turn before: its blocks and SWA state are stored
    classes, rows, hit_s = layer_classes(model.config), [], 0.0
    for mode, n_win in modes(classes, cfg.windows).items():
        if mode != "hit":
            store.swa_tier.clear()  # the SWA state expired
        served = server(ReadOnlyStore(store), n_win).serve(prompt)
        expected = ServeKind.HIT if mode == "hit" else ServeKind.REPLAY
        if served.kind != expected:
            raise RuntimeError(f"{mode}: the prompt was served as a {served.kind}, not a {expected}")
        _, got = decode_steps(model, served.cache, served.logits, cfg.new_tokens, cfg.method,
                              forced=ref_tokens)
        kl = kl_rows(ref, _log_probs(got))
        agree = got.argmax(-1) == torch.tensor(ref_tokens)
        hit_s = served.ttft_s if mode == "hit" else hit_s
        rows.append({
            "mode": mode, "split": split, "reused": served.reused_tokens,
            "n_win": replay_window(classes, n_win, cfg.block) if mode != "hit" else 0,
            "replayed": served.computed_tokens - (len(prompt) - served.reused_tokens),
            "kl": kl.tolist(), "top1": agree.double().mean().item(), "same_greedy": bool(agree.all()),
            "ttft_s": served.ttft_s, "cold_s": cold.ttft_s, "over_cold": served.ttft_s / cold.ttft_s,
            "over_hit": served.ttft_s / hit_s,
        })
    return rows


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per mode: the KL distribution over every compared step, greedy agreement, TTFT ratios (medians)."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        kl = [x for r in mine for x in r["kl"]]
        out[mode] = {
            "samples": len(mine), "replayed_mean": statistics.fmean(r["replayed"] for r in mine),
            "kl_mean": statistics.fmean(kl), "kl_p50": _quantile(kl, 0.5), "kl_p95": _quantile(kl, 0.95),
            "kl_max": max(kl), "kl_first_max": max(r["kl"][0] for r in mine),
            "top1": statistics.fmean(r["top1"] for r in mine),
            "same_greedy": statistics.fmean(r["same_greedy"] for r in mine),
            "ttft_s": statistics.median(r["ttft_s"] for r in mine),
            "over_hit": statistics.median(r["over_hit"] for r in mine),
            "over_cold": statistics.median(r["over_cold"] for r in mine),
        }
    return out


def markdown(result: dict, command: str) -> str:
    """The summary table, with what was run and what it means."""
    cfg, summary = result["config"], result["summary"]
    lines = [
        f"# replay-check: {cfg['model']}, `{cfg['method']}`", "",
        f"{cfg['prompts']} prompts x {cfg['splits']} random split points in ({cfg['block']}, "
        f"{cfg['tokens'] - cfg['turn_tokens']:,}] tokens (where the turn before ended; the store holds its "
        f"{cfg['block']}-token blocks), then a turn of {cfg['turn_tokens']} tokens served each way and "
        f"{cfg['new_tokens']} decode steps each fed the cold run's greedy tokens. "
        + (f"Sliding window {result['window']}, exact replay {result['exact_tokens']:,} tokens (from the "
           "block boundary at or before them, capped at the cached prefix). " if result["window"] else "")
        + f"Cold prefill TTFT (median) {result['cold_s']:.3f} s.", "",
        "```bash", command, "```", "",
    ]
    if result["window"] == 0:
        lines += ["The model has no sliding layers: its global KV is its whole state, a warm turn is always "
                  "a hit and there is no replay to check.", ""]
    lines += [
        "| mode | tokens replayed (mean) | KL mean | KL p50 | KL p95 | KL max | greedy top-1 agreement | "
        "same greedy answer | TTFT (median) | x hit | x cold |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, s in summary.items():
        lines.append(
            f"| {mode} | {s['replayed_mean']:,.0f} | {s['kl_mean']:.2e} | {s['kl_p50']:.2e} | "
            f"{s['kl_p95']:.2e} | {s['kl_max']:.2e} | {s['top1']:.3f} | {s['same_greedy']:.2f} | "
            f"{s['ttft_s']:.3f} s | {s['over_hit']:.2f} | {s['over_cold']:.2f} |")
    lines += ["", "KL: nats, of each step's next-token distribution against the cold run's on the same "
              "tokens, over every step of every sample. x hit / x cold: median over samples of the ratio to "
              "that prompt's hit and cold TTFT in this run."]
    return "\n".join(lines) + "\n"


def run(cfg: ReplayCheckConfig, out: Path) -> dict:
    """Run the check; writes OUT/replay_check.json and .md, returns the result."""
    model, tok = load(cfg.model)
    classes = layer_classes(model.config)
    fingerprint = model_fingerprint(model.config.to_dict(), weights_digest(model))
    rng = random.Random(cfg.seed)
    warm = PrefixServer(model, memory_store(), cfg.method, block_size=cfg.block, fingerprint=fingerprint)
    served = warm.serve(natural_ids(tok, cfg.block + 2, seed=cfg.seed))  # one-time costs off the clock
    decode_steps(model, served.cache, served.logits, 2, cfg.method)
    rows = []
    for p in range(cfg.prompts):
        ids = natural_ids(tok, cfg.tokens, seed=cfg.seed + p)
        for split in split_points(rng, cfg):
            rows += [{"prompt": p, **r} for r in check_split(model, fingerprint, cfg, ids, split)]
    window = max((w for c, w in classes if c == "sliding"), default=0)
    result = {
        "config": asdict(cfg), "window": window, "exact_tokens": replay_window(classes, EXACT, cfg.block),
        "cold_s": statistics.median(r["cold_s"] for r in rows), "summary": summarize(rows), "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RESULTS}.json").write_text(json.dumps(result, indent=1))
    (out / f"{RESULTS}.md").write_text(markdown(result, cfg.command(str(out))))
    return result
