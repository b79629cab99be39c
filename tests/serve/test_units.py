"""The server's parts in-process: streaming text with stop sequences, sampling, tenant salts, the
write-behind store."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.names import Retention
from kvstrata.place.config import StoreConfig
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.serve.auth import APIKeys, tenant_salt
from kvstrata.serve.errors import APIError
from kvstrata.serve.sampling import Sampler, Sampling
from kvstrata.serve.schemas import ChatRequest, CompletionRequest, parse
from kvstrata.serve.streaming import TextStream
from kvstrata.serve.write_behind import WriteBehindStore


def utf8(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=40), st.lists(st.text(alphabet="abé\n", min_size=1, max_size=3), max_size=3))
def test_deltas_add_up_to_the_text_and_stop_before_any_stop_sequence(data, stops):
    s = TextStream(utf8, tuple(stops))
    out, stopped = "", False
    for b in data:
        delta, stopped = s.push(b)
        out += delta
        if stopped:
            break
    out += s.finish()
    full = utf8(list(data))
    assert out == s.text and full.startswith(out)
    assert not any(stop in out for stop in stops)
    if stopped:  # cut exactly at the first stop sequence
        assert min(full.find(x) for x in stops if x in full) == len(out)


def test_sampler_greedy_seeded_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert Sampler(Sampling())(logits) == 1
    def draws(seed):
        sampler = Sampler(Sampling(1.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draws(5) == draws(5) and len(set(draws(5))) > 1 and draws(5) != draws(6)
    nucleus = Sampler(Sampling(1.0, top_p=0.5, seed=0))
    # the two tokens that hold the first half of the mass
    assert {nucleus(logits) for _ in range(50)} <= {1, 3}


def test_tenant_salt_binds_key_and_cache_salt():
    salts = {tenant_salt(k, s) for k, s in [("a", "x"), ("b", "x"),
                         ("a", "y"), ("a", None), ("", "ax"), ("ax", "")]}
    assert len(salts) == 6  # length-prefixed: ("", "ax") and ("ax", "") differ too
    keys = APIKeys(["secret-one"])
    assert keys.check("Bearer secret-one") == "secret-one" and APIKeys().check(None) == ""
    for bad in (None, "secret-one", "Bearer", "Bearer secret-two", "Basic secret-one"):
        try:
            keys.check(bad)
            raise AssertionError(f"{bad!r} accepted")
        except APIError as e:
            assert e.status == 401


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "a", "model": "b", "prompt": "x"}', "model"),
    (b'{"model": "a", "prompt": "x", "stream_options": {"include_usage": true, "include_usage": false}}',
     "stream_options.include_usage"),
    (b'{"model": "a", "messages": [{"role": "user", "content": "x"}, {"role": "user", "role": "system"}]}',
     "messages.1.role"),
    (b'{"model": "a", "prompt": "x", "extra": [[{"deep": {"k": 1, "k": 2}}]]}', "extra.0.0.deep.k"),
])
def test_a_key_given_twice_is_refused_at_any_depth(raw, param):
    schema = ChatRequest if b"messages" in raw else CompletionRequest
    with pytest.raises(APIError) as e:
        parse(raw, schema)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message == f"{param}: the key {param.split('.')[-1]!r} is given twice in one JSON object"
    same_key_apart = b'{"model": "a", "prompt": "x", "extra": {"k": 1, "j": {"k": 2}}}'
    assert parse(same_key_apart, CompletionRequest).model == "a"


def test_write_behind_reads_its_own_writes_and_keeps_retention_classes(tmp_path):
    store = WriteBehindStore(DiskTier(tmp_path, 1 << 26), MemoryTier(1 << 24), memory_global_bytes=1 << 24)
    block, ns, other = {"k": torch.arange(6, dtype=torch.float32)}, b"n" * 32, b"o" * 32
    with store._lock:  # the writer waits: the record is certainly pending
        store.put_global("a" * 64, block, {"codec": "bf16"}, namespace=ns)
        got = store.get_global("a" * 64, ns)
        assert torch.equal(got[0]["k"], block["k"]) and got[1] == {"codec": "bf16"} and store.pending == 1
        assert store.get_global("a" * 64, other) is None  # bound to its namespace while pending too
    store.put_global("b" * 64, block, {"codec": "bf16"}, namespace=ns, retention=Retention.IN_MEMORY)
    assert store.flush() and store.pending == 0
    assert set(store.global_tier.keys()) == {"a" * 64}  # "in_memory" never reached the disk
    assert store.memory_tier.keys() == ["b" * 64]
    # read from RAM, promoted: "24h" asked
    assert torch.equal(store.get_global("b" * 64, ns)[0]["k"], block["k"])
    assert store.flush() and set(store.global_tier.keys()) == {"a" * 64, "b" * 64}
    assert torch.equal(store.get_global("a" * 64, ns)[0]["k"], block["k"])  # written, read back verified
    store.close()


def test_write_behind_store_reads_its_records_after_a_restart(tmp_path):
    """`open` uses the store's persistent secret: a new process on the same root reads what the old
    one wrote."""
    cfg = StoreConfig(root=str(tmp_path / "store"))
    block, ns = {"k": torch.arange(6, dtype=torch.float32)}, b"n" * 32
    first = WriteBehindStore.open(cfg, 1 << 24)
    first.put_global("a" * 64, block, {"codec": "bf16"}, namespace=ns)
    first.put_swa("a" * 64, block, {"codec": "bf16"}, namespace=ns)
    assert first.close()
    again = WriteBehindStore.open(cfg, 1 << 24)
    assert (
        torch.equal(again.get_global("a" * 64, ns)[0]["k"], block["k"])
        and again.global_tier.stats.corrupt == 0
    )
    assert again.get_swa("a" * 64, ns) is None  # the SWA pool lived in the old process's RAM
    assert again.secret == first.secret
    again.close()
