"""Serving flow on a tiny Gemma-3 (sliding window 16): hit, bounded replay, miss, faults."""

import json

import pytest
import torch

from kvstrata.hf import CompressedCache
from kvstrata.hf.run import forward, prefill_spans
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.redis_tier import RedisTier
from kvstrata.place.store import KVStore

IDS = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5)).tolist()


def make_store(tmp_path):
    return KVStore(DiskTier(tmp_path / "g", 1 << 26), MemoryTier(1 << 24), swa_ttl_s=300)


def exact_logits(model, ids, method="bf16"):
    """The prompt's logits computed as a server computes a miss: cut at each block (8) before its end."""
    cache, logits = CompressedCache(model.config, method), None
    for a, b in prefill_spans(len(ids), None, 8):
        logits = forward(model, torch.tensor([ids[a:b]]), cache)[:, -1]
    return logits


@pytest.fixture
def server(tiny_gemma, tmp_path):
    return PrefixServer(tiny_gemma, make_store(tmp_path), "bf16", block_size=8)


def test_miss_then_hit_reuses_and_matches(server, tiny_gemma):
    cold = server.serve(IDS)
    assert cold.kind == "miss" and cold.computed_tokens == 70 and cold.reused_tokens == 0
    warm = server.serve(IDS)
    assert warm.kind == "hit" and warm.reused_tokens == 64 and warm.computed_tokens == 6
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(cold.logits, exact_logits(tiny_gemma, IDS), atol=1e-5, rtol=0)


def test_next_turn_extends_the_prefix(server):
    server.serve(IDS[:40])
    turn2 = server.serve(IDS)
    assert turn2.kind == "hit" and turn2.reused_tokens == 32


def test_swa_miss_replays_only_the_window(server, tiny_gemma):
    hit = server.serve(IDS) and server.serve(IDS)
    server.store.swa_tier._data.clear()
    replay = server.serve(IDS)
    assert replay.kind == "replay" and replay.reused_tokens == 64
    assert replay.computed_tokens == 70 - (64 - server.n_win)  # never a full prefill
    assert (replay.logits - hit.logits).abs().max() < 0.5  # an approximation: measured, not exact
    assert server.serve(IDS).kind == "hit"  # the rebuilt SWA state was written back


def test_replay_from_the_start_is_exact(tiny_gemma, tmp_path):
    s = PrefixServer(tiny_gemma, make_store(tmp_path), "bf16", block_size=8, n_win=64)
    hit = s.serve(IDS) and s.serve(IDS)
    s.store.swa_tier._data.clear()
    replay = s.serve(IDS)
    assert replay.kind == "replay" and replay.computed_tokens == 70
    torch.testing.assert_close(replay.logits, hit.logits, atol=2e-3, rtol=0)


def test_other_tenant_or_method_never_hits(tiny_gemma, tmp_path):
    store = make_store(tmp_path)
    PrefixServer(tiny_gemma, store, "bf16", block_size=8, tenant=b"a").serve(IDS)
    assert PrefixServer(tiny_gemma, store, "bf16", block_size=8, tenant=b"b").serve(IDS).kind == "miss"
    assert PrefixServer(tiny_gemma, store, "fp8", block_size=8, tenant=b"a").serve(IDS).kind == "miss"


def test_fp4_records_are_smaller_and_serve(tiny_gemma, tmp_path):
    stores = {}
    for method in ("bf16", "nvfp4;sliding=fp8"):
        s = PrefixServer(tiny_gemma, make_store(tmp_path / method.replace(";", "_")), method, block_size=8)
        s.serve(IDS)
        assert s.serve(IDS).kind == "hit"
        stores[method] = s.store.global_tier.nbytes()
    assert stores["nvfp4;sliding=fp8"] < 0.6 * stores["bf16"]  # record headers weigh a lot on tiny blocks


def test_corrupt_block_is_recomputed(server, tiny_gemma):
    cold = server.serve(IDS)
    tier = server.store.global_tier
    victim = sorted(tier.keys())[0]
    path = tier._path(victim)
    path.write_bytes(path.read_bytes()[:-9])
    again = server.serve(IDS)
    assert again.kind in ("miss", "hit", "replay") and tier.stats.corrupt == 1
    assert int(again.logits.argmax()) == int(cold.logits.argmax())


def test_redis_down_still_answers(tiny_gemma, redis_server):
    store = KVStore(RedisTier(redis_server.url, prefix="srv", socket_timeout=0.2), MemoryTier(1 << 24))
    s = PrefixServer(tiny_gemma, store, "bf16", block_size=8)
    s.serve(IDS)
    assert s.serve(IDS).kind == "hit"
    redis_server.stop()
    down = s.serve(IDS)
    assert down.kind == "miss" and down.logits.shape[-1] == tiny_gemma.config.vocab_size
    assert store.global_tier.stats.errors > 0


def _doc(meta: dict) -> dict:
    return json.loads(meta["kv"])


def _with_doc(t: dict, meta: dict, change) -> tuple[dict, dict]:
    doc = _doc(meta)
    change(doc)
    return t, {**meta, "kv": json.dumps(doc)}


def _segment(doc: dict, L: int) -> dict:
    return doc["layers"][str(L)]["segments"][0]


def _meta_mutations():
    """Each takes (tensors, meta, L) with L a layer the record holds (with at least one segment)."""
    return {
        "wrong codec": lambda t, m, L: _with_doc(t, m, lambda d: _segment(d, L)["k"].update(codec="fp8")),
        "dtype not a dtype": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L)["k"].update(dtype="nn")),
        "dtype names a function": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L)["v"].update(dtype="zeros")),
        "shape not numbers": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L)["k"].update(shape=["a", "b", "c", "d"])),
        "shape of another layout": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L)["k"].update(shape=_segment(d, L)["k"]["shape"][::-1])),
        "tokens not a number": lambda t, m, L: _with_doc(t, m, lambda d: d.update(tokens="many")),
        "length beyond the codes": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L).update(length=_segment(d, L)["length"] + 1)),
        "skip past the length": lambda t, m, L: _with_doc(
            t, m, lambda d: _segment(d, L).update(skip=_segment(d, L)["length"])),
        "another format": lambda t, m, L: _with_doc(t, m, lambda d: d.update(format=0)),
        "a layer missing": lambda t, m, L: _with_doc(
            {k: v for k, v in t.items() if not k.startswith(f"L{L}.")}, m, lambda d: d["layers"].pop(str(L))),
        "a tensor cut short": lambda t, m, L: (
            {k: v[..., :1] if k.startswith(f"L{L}.s0.k") else v for k, v in t.items()}, m,
        ),
        "a part missing": lambda t, m, L: ({k: v for k, v in t.items() if k != min(
            k for k in t if k.startswith(f"L{L}.s0.v."))}, m),
        "a tensor nobody claims": lambda t, m, L: ({**t, f"L{L}.s7.k.codes": torch.zeros(1)}, m),
        "another layer's index": lambda t, m, L: (
            {k.replace(f"L{L}.", "L99.", 1) if k.startswith(f"L{L}.") else k: v for k, v in t.items()}, m,
        ),
        "no metadata": lambda t, m, L: (t, {}),
        "sink rows where the recipe keeps none": lambda t, m, L: (
            {**t, f"L{L}.sink.k": torch.zeros(1, t[f"L{L}.s0.v.values"].shape[1], 2, 32,
                                              dtype=torch.bfloat16),
             f"L{L}.sink.v": torch.zeros(1, t[f"L{L}.s0.v.values"].shape[1], 2, 32,
                                         dtype=torch.bfloat16)}, m),
    }


@pytest.mark.parametrize("klass", ["global", "swa"])
@pytest.mark.parametrize("mutation", list(_meta_mutations()))
def test_resigned_record_that_does_not_decode_is_a_counted_miss(server, tiny_gemma, mutation, klass):
    """The mutated record is signed with the store's own secret: only decoding can catch it."""
    from kvstrata.place.records import encode_record

    cold = server.serve(IDS)
    tier = server.store.global_tier if klass == "global" else server.store.swa_tier
    victim = sorted(tier.keys())[0]
    tensors, meta = (server.store.get_global if klass == "global" else server.store.get_swa)(
        victim, server.ns
    )
    layer = min(int(L) for L, e in _doc(meta)["layers"].items() if e["segments"])
    tensors, meta = _meta_mutations()[mutation](tensors, meta, layer)
    tier.put(
        victim,
        encode_record(
            tensors, meta, key=victim, secret=server.store.secret, klass=klass, namespace=server.ns
        ),
        ttl_s=None if klass == "global" else 300,
    )
    again = server.serve(IDS)  # never raises
    assert tier.stats.corrupt == 1
    assert again.kind in (("miss", "replay") if klass == "global" else ("replay",))
    torch.testing.assert_close(again.logits, cold.logits, atol=0.5, rtol=0)
    assert server.serve(IDS).kind == "hit"  # the block was recomputed and written back, verified


def test_full_attention_model_warm_turn_is_a_hit(tiny_llama, tmp_path):
    s = PrefixServer(tiny_llama, make_store(tmp_path), "bf16", block_size=8, n_win=64)
    cold = s.serve(IDS)
    warm = s.serve(IDS)  # no sliding layers: no SWA state to lose, nothing to replay
    assert warm.kind == "hit" and warm.reused_tokens == 64 and warm.computed_tokens == 6
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", ["streaming:keep=0.5+nvfp4", "depth:g=2+nvfp4"])
def test_specs_the_store_cannot_hold_are_refused(tiny_gemma, tmp_path, spec):
    store = make_store(tmp_path)
    with pytest.raises(ValueError, match="keep policies do not apply|does not hold them"):
        PrefixServer(tiny_gemma, store, spec, block_size=8)
    written = [p for p in (tmp_path / "g").rglob("*") if not p.name.startswith(".kvstrata")]
    assert not written


KNOBS = ["nvfp4;layers[0]=fp8", "nvfp4:smooth=0.5", "nvfp4:outliers=2,ofmt=fp8", "nvfp4:v=fp8",
         "nvfp4:sink=3", "nvfp4:center=1", "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3,rot=hadamard",
         "int2:group=16,r=4,center=1;sliding=int4:keys=channel,group=16,r=0,sink=2"]


@pytest.mark.parametrize("spec", KNOBS)
def test_every_knob_the_grammar_takes_is_stored_as_held(tiny_gemma, tiny_llama, tmp_path, spec):
    """Records carry the codes and their transform state as the cache held them: a hit's cache reads
    what the writer's did (key groups cut across blocks, sinks, side channels, a tail sealed at each
    block boundary), so its logits are the miss's."""
    for model in (tiny_gemma, tiny_llama):
        s = PrefixServer(model, make_store(tmp_path / model.config.model_type), spec, block_size=8)
        cold = s.serve(IDS)
        warm = s.serve(IDS)
        assert (cold.kind, warm.kind, warm.reused_tokens) == ("miss", "hit", 64)
        torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=0)
        s.store.swa_tier.clear()
        replay = s.serve(IDS)
        assert replay.kind == ("replay" if model is tiny_gemma else "hit")


def _states(t: dict, name: str) -> list[str]:
    return [k for k in t if k.endswith(f".{name}")]


STATE_MUTATIONS = {
    "a per-tensor scale stored per token": ("nvfp4", "tensor_scale", lambda v: v.reshape(1, 1, 1, 1)),
    "a repeated outlier channel": ("nvfp4:outliers=2", "idx", lambda v: v[..., :1].expand_as(v).clone()),
    "an outlier channel past head_dim": ("nvfp4:outliers=2", "idx", lambda v: v + 1000),
    "a NaN mean": ("nvfp4:center=1", "mean", lambda v: v * float("nan")),
    "a zero smoothing divisor": ("nvfp4:smooth=0.5", "scale", lambda v: v * 0),
}


@pytest.mark.parametrize("mutation", list(STATE_MUTATIONS))
def test_a_transform_state_that_could_not_have_been_fitted_is_a_counted_miss(tiny_gemma, tmp_path, mutation):
    """Re-signed, with its digest recomputed: only the transform's own check of its state (or the
    check of a part's layout) can tell."""
    from kvstrata.codecs.transform import Fitted
    from kvstrata.place.records import encode_record

    spec, name, change = STATE_MUTATIONS[mutation]
    server = PrefixServer(tiny_gemma, make_store(tmp_path), spec, block_size=8)
    cold = server.serve(IDS)
    tier = server.store.global_tier
    victim = sorted(tier.keys())[0]
    tensors, meta = server.store.get_global(victim, server.ns)
    doc = json.loads(meta["kv"])
    for key in _states(tensors, name):
        layer = key.split(".")[0][1:]
        tensors[key] = change(tensors[key])
        recipe = server.spec.recipe("full", int(layer))
        states = ({n.split(".")[-1]: tensors[n] for n in tensors if n.startswith(f"L{layer}.state.")},)
        doc["layers"][layer]["digest"] = Fitted(recipe.transforms, states).digest()
    meta = {**meta, "kv": json.dumps(doc)}
    tier.put(victim, encode_record(tensors, meta, key=victim, secret=server.store.secret, klass="global",
                                   namespace=server.ns))
    again = server.serve(IDS)
    assert tier.stats.corrupt == 1 and again.kind in ("miss", "replay")
    torch.testing.assert_close(again.logits, cold.logits, atol=0.5, rtol=0)


def test_a_full_precision_tail_in_a_block_record_is_a_counted_miss(server):
    """Block records hold a layer's tail rows encoded; raw rows in one were not written by a cache."""
    from kvstrata.place.records import encode_record

    server.serve(IDS)
    tier = server.store.global_tier
    victim = sorted(tier.keys())[0]
    tensors, meta = server.store.get_global(victim, server.ns)
    layer = json.loads(meta["kv"])["layers"]
    L = next(k for k in layer)
    heads = tensors[f"L{L}.s0.v.values"].shape[1]
    tensors = {**tensors, f"L{L}.tail.k": torch.zeros(1, heads, 2, 32), f"L{L}.tail.v": torch.zeros(1, heads,
                                                      2, 32)}
    tier.put(victim,
             encode_record(tensors, meta, key=victim, secret=server.store.secret, namespace=server.ns))
    server.serve(IDS)
    assert tier.stats.corrupt == 1


def test_a_bf16_model_stores_and_hits_with_key_transforms(tiny_llama, tmp_path):
    """Centering and smoothing make float32 keys of a bf16 model: the records say so and read back."""
    import copy

    model = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    s = PrefixServer(model, make_store(tmp_path), "nvfp4:center=1,smooth=0.5,outliers=2", block_size=8)
    cold, warm = s.serve(IDS), s.serve(IDS)
    assert warm.kind == "hit" and s.store.global_tier.stats.corrupt == 0
    torch.testing.assert_close(warm.logits, cold.logits, atol=0, rtol=0)


def test_a_residual_longer_than_a_block_is_sealed_and_read(tiny_llama, tmp_path):
    """A residual longer than a block (r=64 > 16): every token is still in the full-precision tail
    when the prompt reaches a block boundary, so the seal there fits the transforms and encodes
    them; the next fused decode step reads side parts from those codes."""
    s = PrefixServer(tiny_llama, make_store(tmp_path), "nvfp4:r=64,outliers=2", block_size=16)
    served = s.serve(IDS[:33])
    layer = served.cache.layers[0]
    assert layer.fitted is not None and sum(seg.visible for seg in layer.segments) == 32

    logits = forward(tiny_llama, torch.tensor([[5]]), served.cache)
    assert torch.isfinite(logits).all()
