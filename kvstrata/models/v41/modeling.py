"""The V4.1 reference model: CSA2 attention (Full / Reindex / Reuse), per-layer SWA, the Causal
Encoder-Decoder split and half-depth prefill with decoder SWA bounded replay.

Built on transformers: `PreTrainedModel` + `GenerationMixin` (so `generate` works), DeepSeek-V4's
RMSNorm, lightning-indexer scorer and RoPE helper. Dense SwiGLU MLP (MoE and hyper-connections
are not the subject here).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer, DeepseekV4RMSNorm

from kvstrata.models.v41 import csa2
from kvstrata.models.v41.cache import V41Cache
from kvstrata.models.v41.config import V41Config


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class V41Attention(nn.Module):
    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.mode, self.m = cfg.layer_modes[layer], cfg.compress[layer]
        h, d, nh = cfg.hidden_size, cfg.latent_dim, cfg.num_attention_heads
        self.q_proj, self.o_proj = _linear(h, nh * d), _linear(nh * d, h)
        self.swa_proj, self.swa_norm = _linear(h, d), DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(nh)) if cfg.attn_sink else None
        self.swa_v_proj = _linear(h, d) if cfg.separate_swa_v(layer) else None
        if self.mode == "full":
            self.global_norm = DeepseekV4RMSNorm(h, cfg.rms_norm_eps)
            self.kv_proj, self.kv_norm = _linear(h, d), DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
            self.ik_proj, self.ik_norm = _linear(
                h, cfg.index_dim), DeepseekV4RMSNorm(cfg.index_dim, cfg.rms_norm_eps)
            if self.m > 1:
                self.kv_gate, self.ik_gate = _linear(h, d), _linear(h, cfg.index_dim)
        if self.mode in ("full", "reindex"):
            self.iq_proj = _linear(h, cfg.index_heads * cfg.index_dim)
            self.scorer = DeepseekV4IndexerScorer(SimpleNamespace(
                index_head_dim=cfg.index_dim, index_n_heads=cfg.index_heads, hidden_size=h))

    def write_global(self, h_src: torch.Tensor, store, ctx: dict) -> None:
        """Project, compress (m positions per entry), RoPE at entry positions j*m, store; leaves
        every entry so far (as stored) in `ctx`."""
        x = self.global_norm(h_src)
        xi = x.detach()  # the indexer learns from its own KL objective only (V3.2: detached input)
        proj = {"kv": self.kv_proj(x), "ik": self.ik_proj(xi)}
        if self.m > 1:
            proj |= {"kv_gate": self.kv_gate(x), "ik_gate": self.ik_gate(xi)}
        if store is not None and store.pending:
            proj = {k: torch.cat([store.pending[k], v], dim=1) for k, v in proj.items()}
        full = proj["kv"].shape[1] // self.m * self.m
        if store is not None:
            store.pending = (
                {k: v[:, full:].detach().clone() for k, v in proj.items()}
                if full < proj["kv"].shape[1]
                else {}
            )
        done = {k: v[:, :full] for k, v in proj.items()}
        first = len(store.latents) if store is not None else 0
        lat = self.kv_norm(csa2.compress(done["kv"], done.get("kv_gate"), self.m))
        lat = csa2.rope(
            lat, (first + torch.arange(lat.shape[1])) * self.m, self.cfg.rope_dim, self.cfg.rope_theta
        )
        ik = self.ik_norm(csa2.compress(done["ik"], done.get("ik_gate"), self.m))
        if store is None:
            ctx.update(lat=lat, ik=ik)
            return
        if lat.shape[1]:
            store.latents.append(lat)
            store.index_keys.append(ik)
        empty_l, empty_i = lat[:, :0], ik[:, :0]
        ctx.update(
            lat=store.latents.read(lat.dtype) if len(store.latents) else empty_l,
            ik=store.index_keys.read(ik.dtype) if len(store.index_keys) else empty_i,
        )

    def select(self, x: torch.Tensor, pos: torch.Tensor, ctx: dict, src: dict | None) -> None:
        """Top-k global entries per query into `ctx` (own scores, re-scored candidates or reused)."""
        cfg = self.cfg
        if self.mode == "reuse":
            ctx.update(lat=src["lat"], idx=src["idx"], cand=src.get("cand"), m=src["m"])
            return
        own = ctx if self.mode == "full" else src
        m = self.m if self.mode == "full" else src["m"]
        b, t, _ = x.shape
        xi = x.detach()
        iq = self.iq_proj(xi).view(b, t, cfg.index_heads, cfg.index_dim)
        vis = csa2.visible(pos, m)
        scores = csa2.causal_scores(self.scorer(iq, own["ik"], xi), vis)
        if self.training:
            ctx["index_scores"] = scores  # trained to follow the main attention (index_loss)
        cand = None
        if self.training and not cfg.train_sparse:  # dense warm-up: attend every visible entry
            idx = (
                torch.arange(scores.shape[-1])
                .expand(b, t, -1)
                .masked_fill(torch.arange(scores.shape[-1]) >= vis[None, :, None], -1)
            )
        elif self.mode == "reindex" and src.get("cand") is not None:
            idx = csa2.rescore(scores, src["cand"], cfg.index_topk)
        elif cfg.hierarchical(self.layer):
            idx, cand = csa2.hierarchical(scores, vis, cfg.index_topk, cfg.hier_block, cfg.hier_blocks)
        else:
            idx = csa2.topk(scores, cfg.index_topk)
        ctx.update(lat=own["lat"], idx=idx, cand=cand if cand is not None else (src or {}).get("cand"), m=m)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, h_src: torch.Tensor | None, store, ctxs: dict
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        ctx = ctxs.setdefault(self.layer, {})
        if self.mode != "swa":
            if self.mode == "full":
                self.write_global(h_src, store, ctx)
            self.select(x, pos, ctx, ctxs.get(cfg.source(self.layer)))
        s = csa2.rope(self.swa_norm(self.swa_proj(x)), pos, cfg.rope_dim, cfg.rope_theta)
        v = self.swa_v_proj(x) if self.swa_v_proj is not None else None
        if store is not None:
            store.write_swa(s, int(pos[0]), v)
            swa, pos0 = store.swa.read(s.dtype), store.swa_pos0
            v = store.swa_v.read(s.dtype) if v is not None else None
        else:
            swa, pos0 = s, int(pos[0])
        q = csa2.rope(
            self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.latent_dim).transpose(1, 2), pos,
            cfg.rope_dim, cfg.rope_theta,
        )
        if "index_scores" in ctx:
            ctxs.setdefault("index_losses", []).append(
                csa2.index_loss(q, ctx["lat"], ctx.pop("index_scores"))
            )
        out = csa2.attend(
            q, pos, swa, pos0, cfg.sliding_window, ctx.get("lat"), ctx.get("idx"), self.sinks, v
        )
        if (
            cfg.derotate and self.swa_v_proj is None
        ):  # K = V: values carry RoPE; rotate back by the query position
            out = csa2.rope(out, -pos, cfg.rope_dim, cfg.rope_theta)
        if store is not None:
            store.trim_swa()
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class V41Layer(nn.Module):
    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.input_norm, self.post_norm = (
            DeepseekV4RMSNorm(h, cfg.rms_norm_eps), DeepseekV4RMSNorm(h, cfg.rms_norm_eps),
        )
        self.attn = V41Attention(cfg, layer)
        self.gate, self.up, self.down = (
            _linear(h, cfg.intermediate_size), _linear(h, cfg.intermediate_size),
            _linear(cfg.intermediate_size, h),
        )

    def forward(self, h, pos, h_src, store, ctxs):
        h = h + self.attn(self.input_norm(h), pos, h_src, store, ctxs)
        x = self.post_norm(h)
        return h + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class V41ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = V41Config
    base_model_prefix = "v41"
    _tied_weights_keys = {"lm_head.weight": "embed.weight"}

    def __init__(self, config: V41Config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(V41Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DeepseekV4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, DeepseekV4RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, V41Attention) and module.sinks is not None:
            nn.init.zeros_(module.sinks)

    def get_input_embeddings(self):
        return self.embed

    def forward(
        self, input_ids: torch.LongTensor, past_key_values=None, use_cache: bool | None = None,
        labels: torch.LongTensor | None = None, logits_to_keep: int = 0, half_depth: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """A prefill into an empty cache of a CED model runs half-depth (`half_depth=False` forces the
        naive full-depth pass): the encoder over every token, the decoder's global KV projected from
        the layer-L/2 input for every token, the decoder itself over the last `n_win` tokens only
        (their logits are the ones returned)."""
        cfg = self.config
        use_cache = (not self.training) if use_cache is None else use_cache
        cache = (
            past_key_values
            if isinstance(past_key_values, V41Cache)
            else (V41Cache(cfg) if use_cache else None)
        )
        b, t = input_ids.shape
        start = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(start, start + t)
        half = cfg.ced and cache is not None and start == 0 and labels is None and half_depth is not False
        h = self.embed(input_ids)
        ctxs: dict = {}
        for i, layer in enumerate(self.layers):
            store = cache.layers[i] if cache is not None else None
            if i == cfg.split:
                h_split = h
                if half:  # half-depth prefill: the decoder replays only the last n_win prompt tokens
                    h, pos, ctxs = h[:, -cfg.n_win :], pos[-cfg.n_win :], {}
            own = h if not (cfg.ced and i >= cfg.split) else h_split
            h = layer(h, pos, own, store, ctxs)
        if cache is not None:
            for layer in cache.layers:
                layer.seen = start + t
        h = self.norm(h)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, cfg.vocab_size).float(), labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
            if ctxs.get("index_losses"):  # the indexer's own objective, as V3.2 / V4 train it
                loss = loss + sum(ctxs["index_losses"]) / len(ctxs["index_losses"])
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
