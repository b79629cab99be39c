"""Codes cross the store boundary as the cache held them: writing a block cuts its codes out (no
decode), a hit installs them (no re-encode). Counted here: every codec `encode` / `decode` call made
inside the store's side of a served request (cutting, packing, writing, looking up, unpacking,
installing) -- the model's own forward, which encodes new tokens once and decodes for its
attention, is outside and not counted."""

import contextlib
from collections import Counter

import pytest
import torch

from kvstrata import registry
from kvstrata.place import prefix_server
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import Entry, KVStore

IDS = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(11))[0].tolist()
OTHER = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(12))[0].tolist()


@contextlib.contextmanager
def counted(monkeypatch):
    """Counts codec calls made while the store's side of serving runs."""
    inside, calls = [0], Counter()

    def boundary(fn):
        def wrapped(*a, **k):
            inside[0] += 1
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= 1
        return wrapped

    for name in ("cut", "pack", "unpack", "install"):
        monkeypatch.setattr(prefix_server, name, boundary(getattr(prefix_server, name)))
    for cls, name in ((KVStore, "put_global"), (KVStore, "put_swa"), (KVStore, "lookup"), (Entry, "open")):
        monkeypatch.setattr(cls, name, boundary(getattr(cls, name)))
    for codec in registry.classes("store").values():
        for op in ("encode", "decode"):
            def call(self, x, *a, _op=op, _fn=getattr(codec, op), **k):
                if inside[0]:
                    calls[_op] += 1
                    calls[f"{_op}d tokens"] += x.shape[-2]
                return _fn(self, x, *a, **k)
            monkeypatch.setattr(codec, op, call)
    yield calls


@pytest.mark.parametrize("spec", ["nvfp4;sliding=fp8",
                                  "int4:keys=channel,group=16,r=0,v=nvfp4,sink=3,rot=hadamard"])
def test_a_write_and_a_hit_neither_decode_nor_encode_again(tiny_gemma, tmp_path, monkeypatch, spec):
    store = KVStore(DiskTier(tmp_path / "g", 1 << 26), MemoryTier(1 << 24))
    server = PrefixServer(tiny_gemma, store, spec, block_size=8)
    server.serve(IDS), server.serve(IDS)  # warm: record checks probe each codec's layout once, cached
    with counted(monkeypatch) as calls:
        cold = server.serve(OTHER)
        assert cold.kind == "miss" and len(store.global_tier.keys()) == 16  # 8 new blocks written
        assert calls == Counter()  # cut from the codes as held: nothing encoded or decoded to write them
        warm = server.serve(OTHER)
    assert warm.kind == "hit" and warm.reused_tokens == 64
    assert calls == Counter()  # installed as held: nothing decoded, nothing encoded again
    torch.testing.assert_close(warm.logits, cold.logits, atol=0, rtol=0)


def test_only_tokens_still_in_full_precision_are_encoded_and_once(tiny_llama, tmp_path, monkeypatch):
    """With a KIVI residual (`r=4`) the newest tokens of a block are not encoded yet when the prompt
    reaches its end: the cache is sealed there (those encoded, once, as the record holds them), so
    writing the records encodes nothing; a hit decodes nothing and encodes nothing."""
    store = KVStore(DiskTier(tmp_path / "g", 1 << 26), MemoryTier(1 << 24))
    server = PrefixServer(tiny_llama, store, "int2:group=16,r=4,keys=token", block_size=8)
    server.serve(IDS), server.serve(IDS)
    monkeypatch.setattr(prefix_server, "seal", _sealing := _counting_seal(prefix_server.seal))
    with counted(monkeypatch) as calls:
        server.serve(OTHER)
        layers = tiny_llama.config.num_hidden_layers
        assert calls == Counter()  # the records: cut from the codes as held
        # sealed at 8, 16, ..., 64: each time the residual's 4 tokens, keys and values, per layer
        assert _sealing == Counter({"encode": 8 * 2 * layers, "encoded tokens": 8 * 2 * 4 * layers})
        _sealing.clear()
        assert server.serve(OTHER).kind == "hit"
    assert calls == Counter() and _sealing == Counter()


class _counting_seal(Counter):
    """`seal`, counting the codec encodes it makes."""

    def __init__(self, seal):
        super().__init__()
        self.seal = seal

    def __call__(self, cache, block):
        from kvstrata.hf import held

        real = held.encode_segment

        def encode(recipe, k, v, *a, **kw):
            self["encode"] += 2
            self["encoded tokens"] += 2 * k.shape[-2]
            return real(recipe, k, v, *a, **kw)

        held.encode_segment = encode
        try:
            self.seal(cache, block)
        finally:
            held.encode_segment = real
