"""`kvstrata.hf.depth_layers`: a group of adjacent full-attention layers encoded once per block."""

import torch

from kvstrata.hf.cache import CompressedCache
from kvstrata.hf.depth_layers import DepthLayer
from kvstrata.hf.run import forward


def test_groups_encode_when_the_last_member_has_the_block(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "depth:g=2,f=1,block=16,mode=exact+bf16:r=4")
    layers = cache.layers
    assert all(isinstance(layer, DepthLayer) for layer in layers[:2]) and layers[0].group is layers[1].group
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    forward(tiny_llama, ids, cache)
    group = layers[0].group
    assert group.encoded_tokens == 36 and layers[0].keys.shape[-2] == 4  # prefill in one block, r=4 kept
    assert group.modes == ["exact"] * layers[0].keys.shape[1]
    assert layers[0].stored_tokens() == layers[1].stored_tokens() == 40
    for step in range(16):  # 16 more tokens: one more block of 16, encoded by the group's last layer
        forward(tiny_llama, ids[:, step : step + 1], cache)
    assert group.encoded_tokens == 52 and len(group.blocks) == 2


def test_members_share_the_group_bytes_exactly(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "depth:g=2,f=1,block=16+bf16:r=0")
    forward(tiny_llama, torch.randint(0, 256, (1, 48)), cache)
    members = cache.layers[0].group.members
    tails = sum(m.keys.numel() * m.keys.element_size() * 2 for m in members)
    assert sum(m.nbytes() for m in members) == members[0].group.nbytes() + tails
    assert members[0].row_bytes()[0] > 0


def test_reset_forgets_the_blocks_and_the_probe(tiny_llama):
    cache = CompressedCache(tiny_llama.config, "depth:g=2,f=1,block=16+bf16:r=0")
    forward(tiny_llama, torch.randint(0, 256, (1, 32)), cache)
    group = cache.layers[0].group
    generations = [m.generation for m in group.members]
    cache.layers[0].reset()
    assert group.blocks == [] and group.modes is None
    # every member's encoded views are stale: each generation moved on
    assert all(m.generation > g for m, g in zip(group.members, generations))
