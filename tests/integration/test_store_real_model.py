"""The persistent store on a real hybrid model (Gemma-3-270M), through the CLI's own store
config: a signed NVFP4 / FP8 store serves a hit that matches the cold logits; a block copied over
another (a whole, validly signed record under the wrong key) is a counted miss, never served."""

import shutil

import pytest

from kvstrata.models import load
from kvstrata.place import KVStore, StoreConfig
from kvstrata.place.prefix_server import PrefixServer
from kvstrata_lab.bench.corpus import natural_ids

pytestmark = pytest.mark.integration


def test_real_model_store_hit_and_swapped_block(tmp_path):
    model, tok = load("gemma3-270m")
    cfg = tmp_path / "store.toml"
    cfg.write_text(f"[store]\nroot = '{tmp_path / 'kv'}'\nblock_size = 128\n")
    config = StoreConfig.load(cfg, env={})
    ids = natural_ids(tok, 1100, seed=11)
    server = PrefixServer(model, KVStore.from_config(
        config), "nvfp4;sliding=fp8", block_size=config.block_size)
    cold = server.serve(ids)
    assert cold.kind == "miss"
    again = PrefixServer(model, KVStore.from_config(
        config), "nvfp4;sliding=fp8", block_size=config.block_size)
    warm = again.serve(ids)  # a new process would read the same secret and records
    assert warm.kind in ("hit", "replay") and warm.reused_tokens == 1024
    assert int(warm.logits.argmax()) == int(cold.logits.argmax())
    tier = again.store.global_tier
    blocks = sorted(tier.root.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    shutil.copyfile(blocks[0], blocks[2])  # LMCache's worst bug: a record served under the wrong key
    swapped = again.serve(ids)
    assert tier.stats.corrupt == 1 and swapped.reused_tokens < 1024
    assert int(swapped.logits.argmax()) == int(cold.logits.argmax())  # recomputed, not served wrong
    assert again.serve(ids).reused_tokens == 1024 and tier.stats.corrupt == 1  # the block was written back
