"""An encoder-decoder through the persistent store, both ways it can keep the decoder half
("projected" K/V or "hidden" `H(split)`, `kvstrata.hf.projected`): bytes per token of what the
records hold, measured from the records themselves, and a hit against the cold run of the same
prompt (logits bit for bit, time to the first token)."""

from __future__ import annotations

import torch

from kvstrata.codecs.qtensor import held_bytes
from kvstrata.hf.held import cut
from kvstrata.hf.projected import CONFIG_KEY, STORED
from kvstrata.place.block_format import pack
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_keys import model_fingerprint
from kvstrata.place.prefix_server import PrefixServer, weights_digest
from kvstrata.place.store import KVStore

BLOCK = 256


def _bytes(layer, upto: int) -> int:
    """Bytes a record of positions [0, upto) holds for one cache layer, as the store packs it."""
    return held_bytes(pack({0: cut(layer, 0, upto, encode_tail=True)}, upto)[0].values())


def _serve(ced, store: KVStore, method: str, ids: list[int], fingerprint: str):
    return PrefixServer(ced, store, method, block_size=BLOCK, fingerprint=fingerprint).serve(ids)


def store_evidence(ced, ids: torch.Tensor, follow: torch.Tensor, method: str) -> list[dict]:
    """Per storage mode: the prompt `ids` served cold into an empty store, then prompts sharing all
    its stored blocks and continuing with `follow`, or with its first `n_win // 4` tokens (where
    "projected" reruns the encoder), each served from it against itself served cold."""
    plan = getattr(ced.config.get_text_config(decoder=True), CONFIG_KEY)
    kept, first = plan.get("store", STORED[0]), ids[0].tolist()
    shared = first[: (len(first) - 1) // BLOCK * BLOCK]
    seconds = [shared + follow[0, :n].tolist() for n in (max(1, ced.n_win // 4), follow.shape[1])]
    rows, digest = [], weights_digest(ced)  # once: the config (its "store") is what differs
    try:
        for mode in STORED:
            plan["store"] = mode
            fp = model_fingerprint(ced.config.to_dict(), digest)
            store = KVStore(MemoryTier(1 << 34), MemoryTier(1 << 32))
            cold_first = _serve(ced, store, method, first, fp)
            upto = len(shared)
            layers = cold_first.cache.stored_layers()
            half = (
                layers[len(layers) - 1 :] if mode == "hidden" else layers[ced.split : len(ced.inner.layers)]
            )
            decoder = sum(_bytes(layer, upto) for layer in half if not layer.is_sliding)
            row = {
                "store": mode,
                "method": method,
                "stored_tokens": upto,
                "record_bytes_per_token": round(store.global_tier.nbytes() / upto, 1),
                "decoder_bytes_per_token": round(decoder / upto, 1),
                "prompts": [],
            }
            for second in seconds:
                hit = _serve(ced, store, method, second, fp)
                cold = _serve(ced, KVStore(MemoryTier(1 << 34), MemoryTier(1 << 32)), method, second, fp)
                row["prompts"].append(
                    {
                        "tokens": len(second),
                        "kind": hit.kind.value,
                        "computed_tokens": {"hit": hit.computed_tokens, "cold": cold.computed_tokens},
                        "hit_equals_cold": bool(torch.equal(hit.logits, cold.logits)),
                        "ttft_s": {"hit": round(hit.ttft_s, 3), "cold": round(cold.ttft_s, 3)},
                    }
                )
            rows.append(row)
    finally:
        plan["store"] = kept
    return rows
