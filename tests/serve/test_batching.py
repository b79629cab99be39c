"""The batched worker in-process: every request's greedy answer equals the unbatched worker's (one
request per forward) and `kvstrata generate`'s -- misses, hits and replays through a real disk
store, requests joining and leaving mid-batch, prefill chunks sharing steps with decodes -- for
every store codec and `;sliding=` recipes, on tiny Llama and tiny Gemma-3; a row that fails fails
alone; the KV budget holds requests back rather than exceeding it."""

import copy
import time

import pytest
import torch
from serve_helpers import Harness, answer, generate_disagreements, generated, prompt, scenario

from kvstrata.hf import linear
from kvstrata.hf.batch import Row, batched_forward
from kvstrata.hf.cache import CompressedCache
from kvstrata.methods import METHODS
from kvstrata.serve.scheduler import Limits, admit, kv_rate, plan
from kvstrata.serve.sessions import Sessions
from kvstrata.serve.worker import Failed, Finished

CODECS = [n for n, e in METHODS.items() if e.stratum == "store"]
SPECS = CODECS + ["nvfp4;sliding=fp8", "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3;sliding=int4:r=0",
                  "nvfp4:sink=4,center=1,rot=hadamard"]

@pytest.fixture
def steps(monkeypatch):
    """The rows' token counts of every forward the worker runs."""
    from kvstrata.serve import worker

    seen: list[list[int]] = []

    def recording(model, rows):
        seen.append([len(r.ids) for r in rows])
        return batched_forward(model, rows)

    monkeypatch.setattr(worker, "batched_forward", recording)
    return seen


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_answers_equal_unbatched_ones(arch, spec, tiny_llama, tiny_gemma, tmp_path, steps):
    model = tiny_llama if arch == "llama" else tiny_gemma
    batched = scenario(model, spec, tmp_path / "b", batching=True)
    shared, steps[:] = list(steps), []
    alone = scenario(model, spec, tmp_path / "u", batching=False)
    assert batched == alone
    assert max(map(len, shared)) >= 3 and all(len(s) == 1 for s in steps)
    assert any(1 in s and max(s) > 1 for s in shared)  # prefill chunks shared steps with decode tokens
    assert max(map(sum, shared)) <= 40 and max(max(s) for s in shared) <= 16  # budget and chunk held
    kinds = [k for _, k in batched]
    assert kinds[:4] == ["miss"] * 4 and kinds[4:7] == ["hit"] * 3
    assert kinds[7:] == (["replay"] * 2 if arch == "gemma3" else ["hit"] * 2)  # Llama has no SWA state
    # `kvstrata generate` cuts and seals a prompt where the server does, and a replay reruns the cold
    # run's chunks, so every lossy cache holds the same codes: the answers are its answers
    assert generate_disagreements(model, spec, batched) == []


@pytest.mark.skipif(linear.kernel() is None, reason="linear_rows needs an AVX-512 build")
@pytest.mark.parametrize("spec", ["bf16", "nvfp4;sliding=fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_answers_equal_unbatched_and_generate_on_the_kernels_linears(arch, spec, tiny_llama,
                                                                             tiny_gemma, tmp_path):
    """What `kvstrata.models.load` gives a served model: its linears on `linear_rows` at a step's few rows."""
    model = copy.deepcopy(tiny_llama if arch == "llama" else tiny_gemma)
    assert linear.install(model) > 0
    batched = scenario(model, spec, tmp_path / "b", batching=True)
    assert batched == scenario(model, spec, tmp_path / "u", batching=False)
    assert generate_disagreements(model, spec, batched) == []


def test_bf16_batched_answers_equal_kvstrata_generate(tiny_gemma, tmp_path):
    h = Harness(tiny_gemma, "bf16", tmp_path, Limits(max_running=4, max_batched_tokens=40, prefill_chunk=16))
    try:
        ids = [prompt(s, n) for s, n in ((5, 50), (6, 33), (7, 70))]
        got = [answer(x)[0] for x in [h.ask(i, 10) for i in ids]]
    finally:
        h.close()
    for i, text in zip(ids, got):  # bf16: another cut (generate's default chunk and block) reads alike
        assert text == ",".join(map(str, generated(tiny_gemma, i, "bf16", 10)[0]))


def test_topk_reads_batched_equal_one_row_at_a_time(tiny_llama):
    spec = "topk:k=16,window=8,schedule=F1U3+nvfp4"
    from kvstrata.hf.topk_attention import read_state

    def decode(batched: bool) -> list[list[int]]:
        caches = [CompressedCache(tiny_llama.config, spec) for _ in range(3)]
        rows = [Row(cache=c, ids=prompt(20 + i, 40 + 13 * i), read=read_state(tiny_llama, c, spec))
                for i, c in enumerate(caches)]
        outs = [[] for _ in rows]
        for _ in range(8):
            logits = (batched_forward(tiny_llama, rows) if batched
                      else torch.cat([batched_forward(tiny_llama, [r]) for r in rows]))
            for r, o, row_logits in zip(rows, outs, logits):
                o.append(int(row_logits.argmax()))
                r.ids = [o[-1]]
        return outs

    assert decode(True) == decode(False)


@pytest.mark.parametrize("fused", [True, False])
def test_a_batched_row_reads_topk_as_the_single_path_does(tiny_llama, fused):
    """One attention function: a batched row with a read state selects as `reading()` does for the
    same cache alone, whether the cache offers its codes (fused) or its dense keys (not fused)."""
    from kvstrata.hf.run import forward
    from kvstrata.hf.topk_attention import read_state, reading

    spec = "topk:k=8,window=4,schedule=F1+nvfp4"
    ids = prompt(3, 40)
    single = CompressedCache(tiny_llama.config, spec, fused=fused)
    forward(tiny_llama, torch.tensor([ids]), single)
    with reading(tiny_llama, single, spec) as state:
        want = [forward(tiny_llama, torch.tensor([[t]]), single)[0, -1] for t in (5, 9, 11)]
    batched = CompressedCache(tiny_llama.config, spec, fused=fused)
    row = Row(cache=batched, ids=ids)
    batched_forward(tiny_llama, [row])
    row.read = read_state(tiny_llama, batched, spec)
    got = []
    for t in (5, 9, 11):
        row.ids = [t]
        got.append(batched_forward(tiny_llama, [row])[0])
    assert state.bytes_read > 0 and row.read.bytes_read == state.bytes_read  # both selected, alike
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_failing_row_fails_alone(tiny_gemma):
    caches = [CompressedCache(tiny_gemma.config, "nvfp4") for _ in range(3)]
    rows = [Row(cache=c, ids=prompt(30 + i, 20)) for i, c in enumerate(caches)]
    alone = [Row(cache=CompressedCache(tiny_gemma.config, "nvfp4"), ids=r.ids) for r in rows]
    want = [batched_forward(tiny_gemma, [row])[0] for row in alone]

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    caches[1].layers[2].append = broken
    got = batched_forward(tiny_gemma, rows)
    assert isinstance(rows[1].error, RuntimeError) and rows[0].error is None and rows[2].error is None
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-4)


def test_a_worker_row_failure_is_a_500_for_that_request_only(tiny_llama, tmp_path, monkeypatch):
    h = Harness(tiny_llama, "nvfp4", tmp_path, Limits(max_running=4, max_batched_tokens=64, prefill_chunk=32))
    bad = prompt(41, 30)
    real = Sessions.begin

    def begin(self, ids, tenant, retention):
        prefill = real(self, ids, tenant, retention)
        if ids == bad:
            def broken(*args, **kwargs):
                raise RuntimeError("injected")
            prefill.cache.layers[1].append = broken
        return prefill

    monkeypatch.setattr(Sessions, "begin", begin)
    try:
        good = [h.ask(prompt(40, 30), 6), h.ask(bad, 6), h.ask(prompt(42, 30), 6)]
        for x in good:
            x["done"].wait(120)
        assert isinstance(good[1]["event"], Failed) and good[1]["event"].error.status == 500
        assert all(isinstance(good[i]["event"], Finished) for i in (0, 2))
    finally:
        h.close()


def test_plan_and_admission():
    lim = Limits(max_running=3, max_batched_tokens=20, prefill_chunk=8)
    assert plan([0, 1], [(2, 8), (3, 8), (4, 8)], lim, 0) == [0, 1, 2, 3]  # 2 + 16 <= 20; 26 > 20
    assert plan([], [(5, 8)], Limits(max_batched_tokens=8, prefill_chunk=8), 0) == [5]
    one = Limits(batching=False)
    assert plan([0, 1], [(2, 8)], one, 0) == [2] and plan([0, 1], [], one, 3) == [1]
    budget = Limits(max_running=8, kv_budget_bytes=100)
    assert admit([40, 40, 40], 0, 0, budget) == 2  # the third waits: 120 > 100
    assert admit([60, 10], 1, 50, budget) == 0  # first come first served: 10 would fit, 60 does not
    assert admit([500], 0, 0, budget) == 1  # alone (the server refuses what exceeds the whole budget)
    assert admit([1] * 9, 0, 0, budget) == 8


def test_kv_rate_counts_the_codec_bytes(tiny_gemma):
    bf16, fp4 = kv_rate(tiny_gemma.config, "bf16"), kv_rate(tiny_gemma.config, "nvfp4")
    assert 3.0 < bf16.per_token / fp4.per_token < 4.0
    held = CompressedCache(tiny_gemma.config, "nvfp4")
    batched_forward(tiny_gemma, [Row(cache=held, ids=prompt(50, 300))])
    assert held.nbytes()["total"] <= fp4.bytes(300)


@pytest.mark.parametrize("spec", SPECS + ["int4:keys=token,group=16,r=0,v=int4,vgroup=8,fit=lsq",
                                          "nvfp4:fit=lsq,rot=hadamard,center=1", "fp8:block=32,r=2"])
def test_flushing_many_rows_at_once_holds_the_codes_one_flush_each_holds(spec, tiny_llama):
    """A batched step encodes every row's new token in one call per codec: what each layer then holds
    is byte for byte what its own flush holds."""
    from kvstrata.hf.layers import flush_many

    def held(batched: bool) -> list[list[torch.Tensor]]:
        caches = [CompressedCache(tiny_llama.config, spec) for _ in range(4)]
        for i, c in enumerate(caches):
            batched_forward(tiny_llama, [Row(cache=c, ids=prompt(60 + i, 30 + 7 * i))])
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            layers = [c.layers[0] for c in caches]
            for layer in layers:
                k = torch.randn(1, *layer.keys.shape[1:2], 1, layer.keys.shape[-1], generator=g) * 3
                layer.append(k, k.flip(-1), offer=True, defer=True)
            if batched:
                flush_many(layers)
            else:
                for layer in layers:
                    flush_many([layer])
        return [[t.clone() for t in c.layers[0].held()] for c in caches]

    for a, b in zip(held(True), held(False)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_request_cancelled_mid_batch_leaves_the_others_answers_unchanged(tiny_gemma, tmp_path):
    limits = Limits(max_running=4, max_batched_tokens=40, prefill_chunk=16)
    ids = [prompt(70 + i, 30 + 9 * i) for i in range(3)]
    alone = Harness(tiny_gemma, "nvfp4", tmp_path / "a", limits)
    try:
        want = [answer(alone.ask(i, 12)) for i in ids[:2]]
    finally:
        alone.close()
    h = Harness(tiny_gemma, "nvfp4", tmp_path / "b", limits)
    try:
        handles = [h.ask(i, 12 if n < 2 else 400) for n, i in enumerate(ids)]
        while handles[2]["deltas"] < 2:
            time.sleep(0.001)
        h.cancel(handles[2])
        assert [answer(x) for x in handles[:2]] == want
        assert handles[2]["done"].wait(60) and handles[2]["event"].outcome.finish_reason == "cancelled"
    finally:
        h.close()
