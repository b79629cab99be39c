"""The connector's vLLM-free parts, in our own environment: page maps over packed layouts, chunk
records, the scheduler-side plan and the config checks."""

import os

import pytest
import torch

from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.records import RecordError
from kvstrata.place.store import KVStore
from kvstrata.vllm.chunks import ChunkCodec
from kvstrata.vllm.pages import LayoutError, PageMap
from kvstrata.vllm.plan import Groups, Planner
from kvstrata.vllm.settings import ConfigError, Settings, records_namespace

BS, H, D = 32, 3, 64


def packed_writer(k_order: str):
    """A cache writer like vLLM's CPU one: pages `[blocks, heads, 2 * block_size, head_dim]`-sized,
    keys stored in another order (`k_order`: 'transposed' = [head_dim, block_size] per head), values
    token-major."""

    def write(k, v, cache, slots):
        view = cache.view(cache.shape[0], H, 2, BS * D)
        for i, slot in enumerate(slots.tolist()):
            b, t = divmod(slot, BS)
            for h in range(H):
                kd = view[b, h, 0].view(D, BS) if k_order == "transposed" else view[b, h, 0].view(BS, D)
                if k_order == "transposed":
                    kd[:, t] = k[i, h]
                else:
                    kd[t] = k[i, h]
                view[b, h, 1].view(BS, D)[t] = v[i, h]

    return write


@pytest.mark.parametrize("order", ["transposed", "token"])
def test_page_map_finds_a_packed_layout_and_round_trips(order):
    blocks = 5
    cache = torch.randn(blocks, H, BS, 2 * D).bfloat16()
    before = cache.clone()
    pages = PageMap.probe(cache, packed_writer(order), num_blocks=blocks, block_size=BS, kv_heads=H,
                          head_dim=D)
    assert torch.equal(cache, before)  # the probe leaves the cache as it found it
    k, v = torch.randn(H, 70, D).bfloat16(), torch.randn(H, 70, D).bfloat16()
    ids = [3, 1, 4]
    where = pages.where(ids, 10, 70)  # positions 10..79 of a request holding blocks 3, 1, 4
    pages.scatter(cache, where, k, v)
    gk, gv = pages.gather(cache, where)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # what the engine's own writer puts at those slots is what the map reads back
    ref = torch.zeros_like(cache)
    slots = torch.tensor([ids[p // BS] * BS + p % BS for p in range(10, 80)])
    packed_writer(order)(k.transpose(0, 1), v.transpose(0, 1), ref, slots)
    assert torch.equal(torch.stack(pages.gather(ref, where)), torch.stack([k, v]))
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[2], before[2])  # other blocks untouched


def test_page_map_refuses_a_writer_that_changes_values():
    def lossy(k, v, cache, slots):
        packed_writer("token")(k * 0.5, v, cache, slots)

    with pytest.raises(LayoutError):
        PageMap.probe(torch.zeros(2, H, BS, 2 * D), lossy, num_blocks=2, block_size=BS, kv_heads=H,
                      head_dim=D)


def layers(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: (torch.randn(H, n, D, generator=g).bfloat16(), torch.randn(H, n, D, generator=g).bfloat16())
            for i in range(2)}


@pytest.mark.parametrize("method", ["lossless", "nvfp4", "int4:keys=channel,group=32,r=0,v=nvfp4,sink=4"])
def test_chunk_records_round_trip(method):
    codec = ChunkCodec.build(method, ["full", "full"], H, D, torch.bfloat16)
    kv = layers()
    for start in (0, 64):
        out = codec.decode(*codec.encode(kv, start), start=start, tokens=64)
        for i in kv:
            err = (out[i][0].float() - kv[i][0].float()).abs().max()
            assert out[i][0].shape == (H, 64, D) and out[i][0].dtype == torch.bfloat16
            assert err == 0 if method == "lossless" else err < 1.0


def test_chunk_records_refuse_what_they_are_not():
    codec = ChunkCodec.build("nvfp4", ["full", "full"], H, D, torch.bfloat16)
    tensors, meta = codec.encode(layers(), 0)
    with pytest.raises(RecordError):
        codec.decode(tensors, meta, start=0, tokens=32)  # another token count
    other = ChunkCodec.build("lossless", ["full", "full"], H, D, torch.bfloat16)
    with pytest.raises(RecordError):
        other.decode(tensors, meta, start=0, tokens=64)  # another method's record
    wide = ChunkCodec.build("nvfp4", ["full", "full"], H + 1, D, torch.bfloat16)
    with pytest.raises(RecordError):
        wide.decode(tensors, meta, start=0, tokens=64)  # another model's shapes
    with pytest.raises(ValueError, match="bfloat16"):
        ChunkCodec.build("lossless", ["full"], H, D, torch.float32)
    with pytest.raises(ValueError, match="keep"):
        ChunkCodec.build("nvfp4+snapkv:keep=0.5", ["full"], H, D, torch.bfloat16)


def store(tmp_path) -> KVStore:
    return KVStore(DiskTier(tmp_path / "root", 1 << 30), MemoryTier(1 << 20))


def test_plan_saves_each_chunk_once_and_loads_what_verified(tmp_path):
    kv = store(tmp_path)
    ns = bytes(32)
    codec = ChunkCodec.build("nvfp4", ["full", "full"], H, D, torch.bfloat16)
    plan = Planner(kv, ns, chunk_tokens=64, block_size=32)
    tokens = list(range(1000, 1200))  # 3 whole chunks + 8 tokens
    assert plan.matched("a", tokens, b"", 0) == 0
    plan.allocated("a", tokens, b"", 0)
    first = plan.step([("a", (list(range(7)),), True, 0, 100)])  # a prefill chunk of 100 tokens
    assert not first.loads and [(s.first, len(s.keys)) for s in first.saves] == [(0, 1)]
    second = plan.step([("a", None, False, 100, 100)])
    assert [(s.first, len(s.keys)) for s in second.saves] == [(1, 2)]
    assert plan.step([("a", None, False, 200, 1)]).saves == []
    for s in first.saves + second.saves:
        for j, key in enumerate(s.keys):
            kv.put_global(key, *codec.encode(layers(seed=j), (s.first + j) * 64), ns)
    # a new request with the same prefix: 3 chunks verified, the last token left to compute
    assert plan.matched("b", tokens, b"", 32) == 3 * 64 - 32
    assert plan.matched("c", tokens, b"tenant", 0) == 0  # another salt: other keys
    # the prompt's last token stays to compute: the last chunk loads its first block only
    assert plan.matched("d", tokens[:192], b"", 0) == 5 * 32
    plan.allocated("b", tokens, b"", 3 * 64 - 32, (list(range(10, 17)),))
    (load,) = plan.step([]).loads  # loaded while the request waits, before it is scheduled
    assert (load.first, load.skip, load.stop, load.blocks) == (0, 32, 192, (list(range(10, 17)),))
    assert load.keys == first.saves[0].keys + second.saves[0].keys
    step = plan.step([("b", (list(range(10, 17)),), True, 192, 8)])
    assert step.loads == [] and step.saves == []  # chunks that came from the store are not written again
    key = second.saves[0].keys[0]
    path = tmp_path / "root" / f"{key}.kv"
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    assert plan.matched("e", tokens, b"", 0) == 64  # a damaged record ends the hit (and is removed)
    assert kv.global_tier.stats.corrupt == 1 and not path.exists()
    # chunks vLLM's own cache holds are neither verified nor loaded: the hit goes on past them
    kv.put_global(key, *codec.encode(layers(seed=1), 64), ns)
    first_path = tmp_path / "root" / f"{first.saves[0].keys[0]}.kv"
    first_path.write_bytes(b"not a record")
    assert plan.matched("f", tokens, b"", 64) == 3 * 64 - 64
    assert first_path.exists()  # never read


def test_hybrid_hits_reach_only_as_far_as_the_pool_holds_the_window(tmp_path):
    """Layers 0, 2 full attention, 1, 3 a 100-token window: a hit at h needs every chunk's global record
    below h and the pool's records of the chunks the window before h touches; vLLM replays no window
    for these layers, so a hit stops where the pool's records stop."""
    kv = store(tmp_path)
    ns = bytes(32)
    groups = Groups(layers=((0, 2), (1, 3)), windows=(None, 100))
    assert groups.persistent == (0, 2) and groups.pooled == (1, 3)
    assert groups.kept_from(1, 320, 32) == 192 and groups.kept_from(0, 320, 32) == 0
    codec = ChunkCodec.build("nvfp4", ["full", "sliding", "full", "sliding"], H, D, torch.bfloat16)
    plan = Planner(kv, ns, chunk_tokens=64, block_size=32, groups=groups)
    tokens = list(range(2000, 2400))  # 6 whole chunks + 16 tokens
    plan.matched("a", tokens, b"", 0)
    plan.allocated("a", tokens, b"", 0)
    (save,) = plan.step([("a", ([1] * 13, [2] * 13), True, 0, 400)]).saves
    assert (save.first, len(save.keys), save.blocks) == (0, 6, ([1] * 13, [2] * 13))
    part = {0: layers(seed=0)[0], 2: layers(seed=1)[0]}
    for j, key in enumerate(save.keys):
        kv.put_global(key, *codec.encode(part, j * 64), ns)
    # global records alone: no hit (the window's sliding KV is nowhere)
    assert plan.matched("b", tokens, b"", 0) == 0 and plan.stats["short_of_window"] == 6
    window = {1: layers(seed=2)[0], 3: layers(seed=3)[0]}
    for j in (2, 3, 4):
        kv.put_swa(save.keys[j], *codec.encode(window, j * 64), ns)
    # a hit at 320 needs positions 192..320 (chunks 3, 4); at 384 also chunk 5, which the pool lacks
    assert plan.matched("c", tokens, b"", 0) == 320
    plan.allocated("c", tokens, b"", 320, ([5] * 11, [0] * 6 + [6] * 5))
    (load,) = plan.step([]).loads
    assert (load.first, len(load.keys), load.skip, load.stop) == (0, 5, 0, 320)
    kv.swa_tier.clear()  # the pool's minutes are over: the hit goes
    assert plan.matched("d", tokens, b"", 0) == 0


def test_settings_say_what_is_wrong(tmp_path):
    assert Settings.parse({}, 32).chunk_tokens == 256
    assert Settings.parse({"chunk_tokens": 64, "method": "nvfp4"}, 32).method == "nvfp4"
    for extra, words in [({"colour": 1}, "unknown kv_connector_extra_config keys ['colour']"),
                         ({"chunk_tokens": 48}, "multiple of vLLM's block size 32"),
                         ({"chunk_tokens": True}, "multiple"), ({"method": ""}, "method must be"),
                         ({"store": str(tmp_path / "nope.toml")}, "store config")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            Settings.parse(extra, 32)


def test_the_namespace_follows_the_model_files(tmp_path):
    """Another weight byte, another config, another method or chunk size: another namespace."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(64))
    first = records_namespace(tmp_path, "nvfp4", "bfloat16", 256)
    assert records_namespace(str(tmp_path), "nvfp4", "bfloat16", 256) == first
    assert records_namespace(tmp_path, "fp8", "bfloat16", 256) != first
    assert records_namespace(tmp_path, "nvfp4", "bfloat16", 512) != first
    assert records_namespace(tmp_path, "nvfp4", "bfloat16", 256, pooled=(0, 1)) != first  # hybrid allocator
    weights.write_bytes(bytes(63) + b"\x01")
    os.utime(weights, ns=(1, 1))  # whatever the clock: a rewritten file is hashed again
    assert records_namespace(tmp_path, "nvfp4", "bfloat16", 256) != first
