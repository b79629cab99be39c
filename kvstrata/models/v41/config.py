"""`V41Config`: the V4.1 reference model's shape, built from the same layouts the accounting reads."""

from __future__ import annotations

from transformers import PretrainedConfig

from kvstrata.models.v41_layout import V41Layout, _source, v41_modes
from kvstrata.models.v41_layout import presets as layouts

MODES = ("swa", "full", "reindex", "reuse")


class V41Config(PretrainedConfig):
    """CSA2 + CED reference. Per layer a mode (`swa` / `full` / `reindex` / `reuse`) and a
    compression m; one shared latent per global entry (K = V, MQA) with `rope_dim` RoPE channels;
    a lightning indexer (`index_heads` x `index_dim`, top-`index_topk`); hierarchical selection
    (blocks of `hier_block` entries, top `hier_blocks` blocks) at decoder Full layers; per-layer SWA
    of `sliding_window`. With `ced`, decoder layers that own global KV project it from the input of
    layer L/2, so a prefill runs the encoder half plus those projections and replays only the
    last `n_win` prompt tokens through the decoder. Training attends every visible global entry
    (V3.2's dense warm-up: the indexer learns from the main attention by KL) unless
    `train_sparse`; evaluation and inference read the top-k selection. DeepSeek-V4's per-head learned
    attention sink (`attn_sink`) and the rotation of the output's rope channels back by the query
    position (`derotate`; K = V, so values carry RoPE) are available, off by default so that the
    committed train-ref runs reproduce (turning them on did not change whether the tiny model learns).
    `swa_values` (a deviation from V4.1, where K = V everywhere): pure-SWA layers project V apart
    from K; the tiny model's pure-SWA bottom layers only learn recall with it."""

    model_type = "kvstrata_v41"

    def __init__(
        self, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 192,
        num_attention_heads: int = 2, latent_dim: int = 32, rope_dim: int = 8, sliding_window: int = 8,
        index_heads: int = 2, index_dim: int = 16, index_topk: int = 8, hier_block: int = 8,
        hier_blocks: int = 4, layer_modes: list[str] | None = None, compress: list[int] | None = None,
        ced: bool = True, n_win: int | None = None, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
        global_codec: str = "nvfp4:tensor_scale=0", swa_codec: str = "fp8", index_codec: str = "mxfp4",
        quantize_cache: bool = True, train_sparse: bool = False, attn_sink: bool = False,
        derotate: bool = False, swa_values: bool = False, tie_word_embeddings: bool = True, **kwargs,
    ):
        if layer_modes is None:
            layer_modes, compress = (list(x) for x in v41_modes(8))
        compress = list(compress) if compress is not None else [0 if m == "swa" else 1 for m in layer_modes]
        bad = [m for m in layer_modes if m not in MODES]
        if bad or len(compress) != len(layer_modes):
            raise ValueError(
                f"layer_modes must be {MODES} with one compression m each; got {layer_modes} / {compress}"
            )
        if rope_dim > latent_dim or rope_dim % 2:
            raise ValueError(f"rope_dim ({rope_dim}) must be even and <= latent_dim ({latent_dim})")
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_attention_heads, self.latent_dim, self.rope_dim = num_attention_heads, latent_dim, rope_dim
        self.sliding_window, self.index_heads, self.index_dim, self.index_topk = (
            sliding_window, index_heads, index_dim, index_topk,
        )
        self.hier_block, self.hier_blocks = hier_block, hier_blocks
        self.layer_modes, self.compress = list(layer_modes), compress
        self.num_hidden_layers = len(layer_modes)
        self.ced, self.n_win = ced, n_win or sliding_window
        self.rms_norm_eps, self.rope_theta = rms_norm_eps, rope_theta
        self.global_codec, self.swa_codec, self.index_codec = global_codec, swa_codec, index_codec
        self.quantize_cache = quantize_cache
        self.train_sparse = train_sparse
        self.attn_sink, self.derotate, self.swa_values = attn_sink, derotate, swa_values
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def split(self) -> int:
        """First decoder layer (L/2): its input feeds the decoder's global KV under CED."""
        return self.num_hidden_layers // 2

    def source(self, layer: int) -> int | None:
        """Layer whose latent (and index keys) a Reindex / Reuse layer reads."""
        return _source(tuple(self.layer_modes), layer)

    def separate_swa_v(self, layer: int) -> bool:
        """Whether `layer` holds SWA V rows apart from its K rows (pure-SWA layers of `swa_values` models)."""
        return self.swa_values and self.layer_modes[layer] == "swa"

    def hierarchical(self, layer: int) -> bool:
        """Decoder Full layers select block-first; Reindex layers re-score their candidates."""
        return self.layer_modes[layer] == "full" and layer >= self.split

    def layout(self) -> V41Layout:
        """The accounting layout of this model (same modes, m, entry codecs)."""
        return V41Layout(
            f"v41-model-{self.num_hidden_layers}", self.num_hidden_layers, self.hidden_size,
            window=self.sliding_window, latent_dim=self.latent_dim, rope_dim=self.rope_dim,
            index_dim=self.index_dim, index_heads=self.index_heads, topk=self.index_topk,
            modes=tuple(self.layer_modes), m=tuple(self.compress),
            main_entry=((self.global_codec, self.latent_dim),),
            index_entry=((self.index_codec, self.index_dim),),
            swa_entry=((self.swa_codec, self.latent_dim),), swa_values=self.swa_values,
        )


def preset(name: str, **overrides) -> V41Config:
    """`v41-flash` (the published shape: meta device only), `tiny-v41` (8 layers, CPU tests) and
    `small-v41` (16 layers, the prefill-time benchmark and training)."""
    if name == "v41-flash":
        lay = layouts()["v41-flash"]
        kw = dict(
            vocab_size=129280, hidden_size=lay.hidden, intermediate_size=3 * lay.hidden,
            num_attention_heads=64, latent_dim=lay.latent_dim, rope_dim=lay.rope_dim,
            sliding_window=lay.window, index_heads=lay.index_heads, index_dim=lay.index_dim,
            index_topk=lay.topk, hier_block=8, hier_blocks=2048, layer_modes=list(lay.modes),
            compress=list(lay.m), n_win=lay.window,
        )
    elif name == "tiny-v41":
        kw = {}
    elif name == "small-v41":
        modes, m = v41_modes(16)
        kw = dict(
            hidden_size=128, intermediate_size=384, num_attention_heads=4, latent_dim=64, rope_dim=16,
            sliding_window=64, index_heads=4, index_dim=32, index_topk=32, hier_blocks=16,
            layer_modes=list(modes), compress=list(m),
        )
    else:
        raise ValueError(f"unknown V4.1 preset {name!r} (known: v41-flash, tiny-v41, small-v41)")
    return V41Config(**{**kw, **overrides})
