"""`kvstrata tune`: the cheapest per-layer assignment over a ladder of recipes that keeps a stated
quality, with a certificate measured on held-out instances.

1. Sensitivity, measured once: for each layer (with `kv_apart`, its keys and its values apart) and
   each rung of the ladder (best first, e.g. `bf16`, `fp8`, `nvfp4:rot=hadamard`,
   `int2:r=32,rot=hadamard`), that layer alone on that rung, every other layer bf16: KL against the
   uncompressed cache on the calibration continuations, and the bytes the layer then holds.
2. A path from every layer on the cheapest rung to every layer on the best: each step takes the
   upgrade that buys the most KL per byte.
3. A binary search along the path for the cheapest point whose calibration quality holds: retrieval
   within `max_drop` of bf16 on the same instances and top-1 agreement at least `top1`.
4. The certificate: the chosen spec and bf16 on held-out instances (disjoint from calibration), the
   scores with their n, the paired difference with its 95 % interval, bytes per token measured.

Everything measured is kept in `OUT/tune_state.json`, so an interrupted run resumes where it stopped.
Calibration instances are drawn with indices the benchmark does not report (100 and up by default):
no parameter is chosen per reported instance.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from statistics import mean

import torch
from tqdm import tqdm

from kvstrata.methods import parse_method, ranges_text, render_recipe
from kvstrata.models import load
from kvstrata_lab.bench import protocol
from kvstrata_lab.bench.config import DEFAULT_LADDER, REFERENCE, TUNE_TASKS, TuneConfig  # noqa: F401 (settings)
from kvstrata_lab.bench.families import family_of
from kvstrata_lab.bench.paired import Delta, paired_delta
from kvstrata_lab.bench.results import usable_score
from kvstrata_lab.bench.tasks import check_fed, make_instance, score_answer


def check_config(cfg: TuneConfig) -> None:
    """Refuse settings the tuner cannot use, before anything loads (each ladder rung parsed)."""
    if len(cfg.ladder) < 2:
        raise ValueError("the ladder needs at least two recipes (best first)")
    for rung in cfg.ladder:
        if ";" in rung:
            raise ValueError(f"ladder rung {rung!r}: one recipe per rung (no ';')")
        parse_method(f"layers[0]={rung}")  # a rung must be assignable to one layer
        if cfg.kv_apart:
            _check_kv_rung(rung)
    if cfg.kv_apart:  # every pairing of a keys rung with a values rung must be one recipe
        for k_rung in cfg.ladder:
            for v_rung in cfg.ladder:
                try:
                    kv_recipe(k_rung, v_rung)
                except ValueError as e:
                    raise ValueError(f"ladder rungs {k_rung!r} (keys) and {v_rung!r} (values) do "
                                     f"not make one recipe: {e}") from None
    if set(cfg.calib) & set(cfg.heldout):
        raise ValueError(f"calibration instances {sorted(set(cfg.calib) & set(cfg.heldout))} are also "
                         "held out: they must be disjoint")
    if cfg.layer_keep not in ("uniform", "mass"):
        raise ValueError(f"--layer-keep must be uniform or mass, got {cfg.layer_keep!r}")
    if not cfg.calib or not cfg.heldout:
        raise ValueError("tuning needs calibration and held-out instances")
    for t in cfg.tasks:
        if t == "report":
            raise ValueError("tune chooses on calibration families only: the report families are what "
                             "its choice is measured on afterwards (use calib)")
        if t not in TUNE_TASKS:
            raise ValueError(f"tune scores retrieval tasks ({', '.join(TUNE_TASKS)}); got {t!r}")


def _check_kv_rung(rung: str) -> None:
    """With keys apart from values, a rung must be one store codec whose values half `v=` can name."""
    rec = parse_method(rung).full
    if rec.keep is not None or rec.vcodec is not None:
        raise ValueError(f"ladder rung {rung!r}: with keys apart from values a rung is one store codec "
                         "(no keep policy or v=)")
    try:
        kv_recipe(REFERENCE, rung)
    except ValueError as e:
        raise ValueError(f"ladder rung {rung!r}: with keys apart from values its codec must be one v= "
                         f"can name: {e}") from None


def kv_recipe(k_rung: str, v_rung: str) -> str:
    """One layer's recipe with keys as on `k_rung` and values as on `v_rung`: the keys' recipe with
    the values' codec, the larger full-precision tail and sink, and the transforms that act on
    values too (rotation) when either has them; `r` and `keys` always written. Equal rungs: the rung
    as given."""
    if k_rung == v_rung:
        return k_rung
    rk, rv = parse_method(k_rung).full, parse_method(v_rung).full
    both = [t for t in rv.transforms if t.acts_on_values and rk.transform(type(t)) is None]
    rec = replace(rk, r=max(rk.r, rv.r), sink=max(rk.sink, rv.sink), vcodec=rv.value_codec,
                  transforms=tuple(sorted(rk.transforms + tuple(both), key=lambda t: t.order)))
    return render_recipe(rec, explicit=("r", "keys"))


class Evaluator:
    """Runs a spec on one instance, once: results live in the state file, prefills in memory."""

    def __init__(self, cfg: TuneConfig, load_model=None):
        self.cfg, self._load = cfg, load_model or load
        self.path = cfg.out / "tune_state.json"
        self.state = json.loads(self.path.read_text()) if self.path.exists() else {"config": cfg.key(),
                                                                                     "results": {}}
        if self.state["config"] != cfg.key():
            raise ValueError(f"{self.path} was measured with {self.state['config']}; use another --out for "
                             f"{cfg.key()}")
        self._model = None
        self.prefills: dict[tuple[str, int], tuple] = {}

    @property
    def model(self):
        if self._model is None:
            self._model = self._load(self.cfg.model)
        return self._model

    def _save(self) -> None:
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def memo(self, key: str, compute):
        """`compute()`, measured once and kept in the state file (a resumed run reads it back)."""
        saved = self.state.setdefault("memo", {})
        if key not in saved:
            saved[key] = compute()
            self._save()
        return saved[key]

    def prefill(self, task: str, index: int, keep: bool = True):
        """(instance, Prefill, fidelity continuation and reference logits or None), kept in memory
        with `keep`."""
        if (task, index) in self.prefills:
            return self.prefills[(task, index)]
        model, tok = self.model
        inst = make_instance(task, tok, self.cfg.length, index, self.cfg.seed, self.cfg.haystack)
        ids = tok(inst.context, return_tensors="pt").input_ids
        check_fed(inst, self.cfg.length, ids.shape[1])
        pre = protocol.prefill(model, ids)
        extra = None
        if task == "fidelity":
            cont = tok(inst.continuation, add_special_tokens=False, return_tensors="pt").input_ids
            extra = (cont, protocol.reference_logits(model, pre, cont))
        found = (inst, pre, extra)
        if keep:
            self.prefills[(task, index)] = found
        return found

    def run(self, task: str, index: int, specs: list[str], keep: bool = True) -> dict[str, dict]:
        """{spec: result} on instance `index` of `task` (`fidelity` or a retrieval task)."""
        results = self.state["results"]
        missing = [s for s in dict.fromkeys(specs) if f"{task}/{index}/{s}" not in results]
        if missing:
            inst, pre, extra = self.prefill(task, index, keep)
            model, tok = self.model
            with torch.inference_mode():
                for spec in missing:
                    results[f"{task}/{index}/{spec}"] = self._one(model, tok, inst, pre, extra, spec)
            self._save()
        return {s: results[f"{task}/{index}/{s}"] for s in specs}

    @staticmethod
    def _one(model, tok, inst, pre, extra, spec: str) -> dict:
        method = parse_method(spec)
        if extra is None:
            res = protocol.ask(model, tok, pre, method, inst.questions[0])
            return {"score": score_answer(res["output"], inst.questions[0].answers),
                    "bytes_per_token": res["kv_bytes"] / pre.tokens}
        cont, ref = extra
        cache, _ = protocol.build_cache(model, pre, method)
        layer_bytes = cache.nbytes()["layers"]
        res = protocol.continuation(model, cache, cont, ref, sum(layer_bytes), None)
        return {"kl": res["kl"], "top1": res["top1"], "layer_bytes": [b / pre.tokens for b in layer_bytes],
                "bytes_per_token": sum(layer_bytes) / pre.tokens}


def units(cfg: TuneConfig, layers: int) -> list[tuple[int, str | None]]:
    """What gets a rung: each layer, or each layer's keys and its values."""
    parts = ("keys", "values") if cfg.kv_apart else (None,)
    return [(layer, part) for layer in range(layers) for part in parts]


def _unit_recipe(rung: str, part: str | None) -> str:
    if part is None:
        return rung
    return kv_recipe(rung, REFERENCE) if part == "keys" else kv_recipe(REFERENCE, rung)


def sensitivity(ev: Evaluator, cfg: TuneConfig) -> tuple[list[list[float]], list[list[float]]]:
    """Per unit (layer, or its keys / values) and rung: mean calibration KL with that unit alone on
    that rung, everything else bf16, and the bytes/token its layer then holds."""
    base = {i: ev.run("fidelity", i, [REFERENCE])[REFERENCE] for i in cfg.calib}
    todo = units(cfg, len(base[cfg.calib[0]]["layer_bytes"]))
    kl = [[0.0] * len(cfg.ladder) for _ in todo]
    size = [[0.0] * len(cfg.ladder) for _ in todo]
    bar = tqdm(total=len(todo) * len(cfg.ladder), desc="tune: layer sensitivity", unit="eval")
    for u, (layer, part) in enumerate(todo):
        for r, rung in enumerate(cfg.ladder):
            spec = REFERENCE if rung == REFERENCE else f"layers[{layer}]={_unit_recipe(rung, part)}"
            got = [ev.run("fidelity", i, [spec])[spec] for i in cfg.calib]
            kl[u][r] = mean(g["kl"] for g in got) if rung != REFERENCE else 0.0
            size[u][r] = mean(g["layer_bytes"][layer] for g in got)
            bar.update(1)
    bar.close()
    return kl, size


def upgrade_path(kl: list[list[float]], size: list[list[float]]) -> list[tuple[int, ...]]:
    """Assignments (rung per layer) from each layer's smallest rung to its lowest-KL one, one upgrade
    per step, each the one that removes the most KL per byte it adds (a rung that holds more bytes
    for no less KL is never taken: on sliding layers a KIVI residual can outweigh the savings)."""
    rungs = range(len(kl[0]))
    cur = [min(rungs, key=lambda r: (size[layer][r], kl[layer][r])) for layer in range(len(kl))]
    path = [tuple(cur)]
    while True:
        best = None
        for layer, i in enumerate(cur):
            for j in rungs:
                gain, cost = kl[layer][i] - kl[layer][j], size[layer][j] - size[layer][i]
                if gain > 0 and cost > 0 and (best is None or gain / cost > best[0]):
                    best = (gain / cost, layer, j)
        if best is None:
            return path
        cur[best[1]] = best[2]
        path.append(tuple(cur))


def render(assign: tuple[int, ...], ladder: tuple[str, ...], kv_apart: bool = False) -> str:
    """A method spec: the most used recipe for every layer (ties: the better rungs), `layers[...]=`
    for the others. `assign`: a rung per unit (with `kv_apart`, keys and values of each layer)."""
    picks = list(zip(assign[::2], assign[1::2])) if kv_apart else [(a,) for a in assign]
    texts = [kv_recipe(ladder[p[0]], ladder[p[-1]]) for p in picks]
    order: dict[str, tuple[int, ...]] = {}  # each recipe's best rung indices
    for p, t in zip(picks, texts):
        order[t] = min(order.get(t, p), p)
    ranked = sorted(order, key=order.__getitem__)
    base = max(ranked, key=texts.count)  # the first of the most used: ties go to the better rungs
    return with_overrides(base, dict(enumerate(texts)), ranked)


def with_overrides(base: str, texts: dict[int, str], order: list[str]) -> str:
    """`base`, then `layers[...]=recipe` for each recipe of `order` but `base`, on the layers whose
    recipe in `texts` (layer -> recipe) it is."""
    return ";".join([base] + [f"layers[{ranges_text([i for i, x in texts.items() if x == t])}]={t}"
                              for t in order if t != base])


def quality(ev: Evaluator, cfg: TuneConfig, spec: str, indices, keep: bool = True,
            desc: str | None = None) -> dict:
    """Spec and bf16 on `indices`: per-instance scores, retrieval on tasks bf16 can do, top-1
    (`desc`: show a progress bar over the instances)."""
    specs = [spec, REFERENCE]
    scores = {s: {} for s in specs}
    cells = [(t, i) for t in (*cfg.tasks, "fidelity") for i in indices]
    fid = {}
    for task, i in tqdm(cells, desc=desc, unit="instance", disable=desc is None):
        got = ev.run(task, i, specs, keep)
        if task == "fidelity":
            fid[i] = got
        else:
            for s, res in got.items():
                scores[s][(task, i)] = res
    ref = {t: mean(scores[REFERENCE][(t, i)]["score"] for i in indices) for t in cfg.tasks}
    usable = [t for t in cfg.tasks if usable_score(ref[t], t)]

    def retrieval(s):
        return mean(mean(scores[s][(t, i)]["score"] for i in indices) for t in usable) if usable else None

    def every(s):
        return {k: v["score"] for k, v in scores[s].items()}

    def flat(s):
        return {k: v["score"] for k, v in scores[s].items() if k[0] in usable}

    return {
        "spec": spec, "indices": list(indices), "usable_tasks": usable,
        "n_questions": len(usable) * len(indices), "retrieval": retrieval(spec),
        "bf16_retrieval": retrieval(REFERENCE), "delta": paired_delta(flat(spec), flat(REFERENCE)),
        "top1": mean(f[spec]["top1"] for f in fid.values()), "kl": mean(f[spec]["kl"] for f in fid.values()),
        "bytes_per_token": mean(v["bytes_per_token"] for v in scores[spec].values()),
        "bf16_bytes_per_token": mean(v["bytes_per_token"] for v in scores[REFERENCE].values()),
        "per_task": {t: mean(scores[spec][(t, i)]["score"] for i in indices) for t in cfg.tasks},
        "per_family": per_family(every(spec), every(REFERENCE)),  # usable or not: the worst is named
    }


def text_family(task: str, index: int) -> str:
    """The family an instance's text and phrasing come from: a calibration family, or a RULER task."""
    return family_of("calib", index).name if task == "calib" else task


def per_family(a: dict, b: dict) -> dict[str, Delta]:
    """The spec's paired Δ against bf16 on each text family's instances (the certificate names the worst)."""
    fams: dict[str, list] = {}
    for key in a.keys() & b.keys():
        fams.setdefault(text_family(*key), []).append(key)
    return {f: paired_delta({k: a[k] for k in ks}, {k: b[k] for k in ks}) for f, ks in sorted(fams.items())}


def passes(q: dict, cfg: TuneConfig) -> bool:
    """The quality budget: retrieval within `max_drop` of bf16 (when any task is usable) and top-1."""
    kept = q["retrieval"] is None or q["retrieval"] >= q["bf16_retrieval"] - cfg.max_drop - 1e-9
    return kept and q["top1"] >= cfg.top1


def check_plain(cfg: TuneConfig) -> None:
    """Refuse what the per-layer search cannot do (without --keep) before anything loads."""
    check_config(cfg)
    if cfg.layer_keep != "uniform":
        raise ValueError("--layer-keep splits a keep policy's budget over layers: give --keep")


def tune(cfg: TuneConfig, load_model=None) -> dict:
    """Search, certify on held-out instances, write `OUT/certificate.json`; returns the certificate."""
    check_plain(cfg)
    ev = Evaluator(cfg, load_model)
    kl, size = sensitivity(ev, cfg)
    path = upgrade_path(kl, size)
    specs = [render(a, cfg.ladder, cfg.kv_apart) for a in path]
    tried: dict[int, dict] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            tried[k] = quality(ev, cfg, specs[k], cfg.calib)
            bar.update(1)
        return passes(tried[k], cfg)

    bar = tqdm(desc="tune: search", unit="candidate")
    lo, hi = 0, len(path) - 1
    if ok(lo):
        hi = lo
    elif ok(hi):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    bar.close()
    held = quality(ev, cfg, specs[hi], cfg.heldout, keep=False, desc="tune: held-out certificate")
    return certify(cfg, tried[hi], held, [tried[k] for k in sorted(tried)],
                   sensitivity_kl=kl, layer_bytes_per_token=size)


def certify(cfg: TuneConfig, calib: dict, held: dict, search: list[dict], **extra) -> dict:
    """The certificate of the spec `calib` and `held` measured (every search writes this one form):
    budget, whether it held on calibration and held-out instances, the candidates tried; written to
    `OUT/certificate.json`."""
    cert = {
        "model": cfg.model, "length": cfg.length, "spec": held["spec"], "ladder": list(cfg.ladder),
        "kv_apart": cfg.kv_apart,
        "budget": {"max_drop": cfg.max_drop, "top1": cfg.top1, "bytes_per_token": cfg.bytes},
        "quality_met_on_calibration": passes(calib, cfg),
        "bytes_met": None if cfg.bytes is None else held["bytes_per_token"] <= cfg.bytes,
        "calibration": _public(calib), "heldout": _public(held),
        "heldout_quality_met": passes(held, cfg),
        "search": [{"spec": q["spec"], "passes": passes(q, cfg),
                    **{k: q[k] for k in ("retrieval", "top1", "kl", "bytes_per_token")}} for q in search],
        **extra,
    }
    (cfg.out / "certificate.json").write_text(json.dumps(cert, indent=1))
    return cert


def _public(q: dict) -> dict:
    d = q["delta"]
    out = {k: v for k, v in q.items() if k not in ("delta", "per_family")}
    out["compression"] = q["bf16_bytes_per_token"] / q["bytes_per_token"]
    out["delta_vs_bf16"] = _delta(d)
    fams = q.get("per_family", {})
    out["delta_per_family"] = {f: _delta(x) for f, x in fams.items()}
    worst = min(fams, key=lambda f: (fams[f].lo, fams[f].mean), default=None)
    out["worst_family"] = None if worst is None else {"family": worst, **_delta(fams[worst])}
    return out


def _delta(d: Delta | None) -> dict | None:
    return None if d is None else {"mean": d.mean, "ci95": [d.lo, d.hi], "n": d.n}
