"""A transformers `Cache` whose layers store K/V through any kvstrata codec.

Built only on the public cache API (`Cache`, `CacheLayerMixin`): the model calls `update` per layer
and attends over what it returns. Per-layer storage lives in `kvstrata.hf.layers`, layers shared
across depth in `kvstrata.hf.depth_layers`; this module picks one per layer from the method spec.
`nbytes()` counts the storage actually held, per layer and in total. While it lives (or until
`close()` / the end of its `with` block) the model attends with kvstrata's attention function
(`kvstrata.hf.attention.enter_scope`), which reads decode steps straight from the codes.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvstrata.hf.attention import enter_scope, reads_encoded
from kvstrata.hf.depth_layers import DepthGroup, DepthLayer
from kvstrata.hf.layers import CompressedLayer, CompressedSlidingLayer, flush_many
from kvstrata.hf.projected import Hidden, ProjectedLayer, ced_plan, ced_stored, check_ced_method, stored_layer
from kvstrata.hf.rows import append_part, offer
from kvstrata.methods import MethodSpec, parse_method


def head_dim(text_config) -> int:
    """Per-head K/V width of a text config (`head_dim`, or hidden size over attention heads)."""
    dim = getattr(text_config, "head_dim", None)
    return dim or text_config.hidden_size // text_config.num_attention_heads


def layer_classes(config) -> list[tuple[str, int | None]]:
    """Per decoder layer: ("full", None) or ("sliding", window), from a transformers config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n
    out = []
    for t in types[:n]:
        if t in ("sliding_attention", "chunked_attention"):
            out.append(("sliding", window if t == "sliding_attention" else text.attention_chunk_size))
        elif t == "full_attention":
            out.append(("full", None))
        else:
            raise ValueError(f"layer type {t!r} is not supported by CompressedCache")
    return out


def check_fits_model(spec: MethodSpec, config) -> list[tuple[str, int | None]]:
    """Refuse a spec the model's shape cannot take (a layer override past its depth, a key transform or
    a top-k indexer its heads do not fit); returns its layer classes. Reads the config alone, so a
    command can check before any weights load."""
    classes = layer_classes(config)
    if spec.max_layer() >= len(classes):
        raise ValueError(f"method {spec.text!r} assigns layer {spec.max_layer()}; the model has "
                         f"{len(classes)} layers (0-{len(classes) - 1})")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads, dim = text.num_key_value_heads, head_dim(text)
    for t in {t for r in spec.recipes() for t in r.transforms}:
        t.check(heads, dim)
    for read in {r.read for r in spec.recipes() if r.read is not None}:
        read.check(dim)
    if ced_plan(text) is not None:
        check_ced_method(spec)
    return classes


class CompressedCache(Cache):
    """`Cache` whose every layer encodes K/V with the recipe for its layer class."""

    def __init__(self, config, method: str | MethodSpec = "bf16", fused: bool = True):
        """`fused`: decode steps attend straight from the encoded segments (kvstrata's attention is
        selected on the model's config for the cache's lifetime; it otherwise behaves as the one it
        replaces)."""
        self.method = parse_method(method) if isinstance(method, str) else method
        text = getattr(config, "get_text_config", None)
        self.text_config = text(decoder=True) if text else config
        self.fused = fused
        classes = check_fits_model(self.method, config)
        keeps = [r.keep for r in self.method.recipes()]
        self._scope = None
        # the hook gathers keep scores, and aligns the mask of layers whose keep policies differ
        if fused or any(k is not None and (k.needs_scores or self.method.layers) for k in keeps):
            self._scope = weakref.finalize(self, enter_scope(self.text_config))
        layers: list[CacheLayerMixin] = []
        for i, (cls, window) in enumerate(classes):
            recipe = self.method.recipe(cls, i)
            sliding = cls == "sliding"
            layers.append(CompressedSlidingLayer(recipe, window) if sliding else CompressedLayer(recipe))
        if self.method.full.depth:
            self._group_depth(layers, classes)
        #: an encoder-decoder model's (split, n_win): its decoder layers hold projected + own K/V
        self.ced = ced_plan(self.text_config)
        if self.ced is not None:
            split, n_win = self.ced
            layers[split:] = [ProjectedLayer(layer, n_win) for layer in layers[split:]]
        #: an encoder-decoder whose store keeps H(split): the rows the decoder half is made from
        hidden = self.ced is not None and ced_stored(self.text_config) == "hidden"
        self.hidden = Hidden(self.method.full) if hidden else None
        #: an encoder-decoder's (first position, encoder output rows) its decoder has not run over yet
        self.pending: tuple[int, torch.Tensor] | None = None
        #: the top-k read state its decode steps select with (`kvstrata.hf.topk_attention.reading`)
        self.read = None
        super().__init__(layers=layers)

    def _group_depth(self, layers: list, classes) -> None:
        """Replace each run of `g` full-attention layers that are neighbours in depth among the
        full-attention layers (sliding layers in between are skipped: Gemma-3's global layers are
        every 6th) with one depth-shared group; leftover layers stay per-layer."""
        recipe = self.method.full
        cfg = recipe.depth
        g, first = cfg.g, int(cfg.start * len(classes))
        self.depth_groups = []
        run: list[int] = []
        for i, (cls, _) in enumerate(classes):
            if cls != "full" or i < first:
                continue
            run.append(i)
            if len(run) == g:
                members = [DepthLayer(recipe, j) for j in range(g)]
                group = DepthGroup(recipe, members)
                for member, idx in zip(members, run):
                    member.group = group
                    layers[idx] = member
                self.depth_groups.append((run, group))
                run = []

    def close(self) -> None:
        """End the attention scope now (also the end of a `with` block, or garbage collection)."""
        if self._scope is not None:
            self._scope()

    def __enter__(self) -> "CompressedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append to layer `layer_idx` as a row of one (`kvstrata.hf.rows.append_part`). A decode step
        whose attention reads encoded views gets only the full-precision tail back; the rest is
        offered to that attention call."""
        layer = self.layers[layer_idx]
        # a step's new tokens are attended in full precision by their own layer, so every layer's
        # encoding can wait for the step's last layer and be done there in one codec call per recipe
        last = layer_idx == len(self.layers) - 1
        defer = not last and type(layer) in (CompressedLayer, CompressedSlidingLayer)
        part = append_part(self, layer_idx, key_states, value_states,
                           reads=reads_encoded(self.text_config), defer=defer)
        if last:
            self.settle()
        offer(layer_idx, [part])  # set on every update, so no offer outlives its attention call
        return part.keys, part.values

    def stored_layers(self) -> list[CompressedLayer]:
        """Every layer's storage as the store's records cut it, `H(split)`'s last (when held)."""
        return [stored_layer(layer) for layer in self.layers] + ([self.hidden] if self.hidden else [])

    def start_replay(self, position: int) -> None:
        """A replay from `position` (`CompressedLayer.start_replay`), `H(split)` included when held."""
        for layer in (*self.layers, *([self.hidden] if self.hidden is not None else [])):
            layer.start_replay(position)

    def reset(self) -> None:
        super().reset()
        if self.hidden is not None:
            self.hidden.reset()
        self.pending = None

    def settle(self) -> None:
        """Encode the tokens layers left for the step's end (`update` does it at the last layer)."""
        due = [layer for layer in self.layers if getattr(layer, "deferred", False)]
        if due:
            flush_many(due)

    def head_modes(self) -> dict[str, int]:
        """How many (group, KV head) pairs each depth mode holds: the probe's decisions, {} without
        depth sharing or before a group is encoded."""
        counts: dict[str, int] = {}
        for group in self.head_mode_map():
            for mode in group["modes"]:
                counts[mode] = counts.get(mode, 0) + 1
        return counts

    def head_mode_map(self) -> list[dict]:
        """Per depth group: its layers and each KV head's mode (what the report plots)."""
        return [
            {"layers": list(run), "modes": list(group.modes)}
            for run, group in getattr(self, "depth_groups", [])
            if group.modes
        ]

    def nbytes(self) -> dict:
        """`{"layers": [bytes per layer], "total": bytes}`, measured from held tensors."""
        self.settle()
        per_layer = [layer.nbytes() for layer in self.layers]
        return {"layers": per_layer, "total": sum(per_layer)}

    def load_prefill(
        self, layers: list[tuple[torch.Tensor, torch.Tensor, int]], scores: list | None = None,
        queries: list | None = None,
    ) -> None:
        """Fill from a prefilled dense cache: per layer `(keys, values, tokens_seen)`, optional
        per-layer keep scores `[batch, kv_heads, n]` and probe queries `[batch, q_heads, w, head_dim]`."""
        if self.ced is not None:
            raise ValueError("an encoder-decoder's cache is filled by its own forward passes (the decoder's "
                             "K/V are projected), not from a dense prefill")
        if len(layers) != len(self.layers):
            raise ValueError(f"load_prefill got {len(layers)} layers, the model has {len(self.layers)}")
        for i, (layer, (k, v, seen)) in enumerate(zip(self.layers, layers)):
            if queries is not None and hasattr(layer, "set_queries"):
                layer.set_queries(queries[i])
            layer.load_prefill(k, v, seen, scores[i] if scores is not None else None)

    def shrink(self) -> None:
        """Free every layer's rows reserved for decode-time appends (e.g. when a generation ends)."""
        for layer in self.layers:
            if hasattr(layer, "shrink"):
                layer.shrink()

    def bytes_per_token(self) -> float:
        """Stored bytes divided by the tokens the cache has seen."""
        n = self.get_seq_length()
        return self.nbytes()["total"] / n if n else 0.0
