"""`CEDModel`: a pretrained causal LM run as the source design's causal encoder-decoder.

Layers below `split` are the encoder; from `split` on, the decoder. The decoder layers' K/V for
every position come from the encoder's last hidden state `H(split)` through one projection per
layer (`Projections`, fitted by `kvstrata.models.ced.fit`); each decoder layer computes its own
K/V only for positions it runs over, which are the newest `n_win` (`kvstrata.hf.projected`).

A forward pass over `n` new tokens: the encoder runs over all of them, the projections make every
decoder layer's K/V for all of them, and the decoder runs over the newest positions only when
logits are asked for (`logits_to_keep`; an empty index tensor asks for none, as a prefill chunk
whose logits are thrown away does): it replays the rows not yet run, at most the last `n_win` of
them (more if more logits are asked for). So a long prompt's prefill costs the encoder plus
`n_win` rows of the decoder. With a prompt of at most `n_win` tokens every query reads only own
K/V: the logits equal the original model's.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvstrata.hf.cache import CompressedCache, head_dim
from kvstrata.hf.held import seal
from kvstrata.hf.projected import CONFIG_KEY, STORED, ced_config


def rms(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The projections' input: `H(split)` scaled to unit RMS per token (no weight: the fit absorbs it)."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama / Qwen2 / Gemma-3 apply it: `x: [batch, heads, n, d]`, cos/sin `[batch, n, d]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def rope_tables(rotary, h: torch.Tensor, pos: torch.Tensor, kinds: set[str], typed: bool) -> dict:
    """Per layer type, the (cos, sin) at `pos` (Gemma-3's rotary embedding takes the layer type)."""
    return {t: rotary(h, pos, t) if typed else rotary(h, pos) for t in kinds}


def head_logits(base, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's head over final (normed) hidden states, softcapped where the model says so."""
    logits = base.lm_head(hidden)
    cap = getattr(base.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


class Projections(nn.Module):
    """One linear map per decoder layer: `rms(H(split))` -> that layer's pre-RoPE K and V."""

    def __init__(self, hidden: int, kv_heads: int, dim: int, layers: int):
        super().__init__()
        self.kv_heads, self.dim = kv_heads, dim
        self.maps = nn.ModuleList(nn.Linear(hidden, 2 * kv_heads * dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of decoder layer `j`: `[batch, kv_heads, n, head_dim]` each, K before RoPE."""
        b, n, _ = x.shape
        kv = self.maps[j](x).view(b, n, 2, self.kv_heads, self.dim).transpose(1, 3)
        return kv[:, :, 0], kv[:, :, 1]


def logit_rows(logits_to_keep, n: int) -> tuple[int, torch.Tensor | slice]:
    """(how many of the chunk's last rows the asked logits need, the selector over those rows)."""
    if isinstance(logits_to_keep, torch.Tensor):
        idx = logits_to_keep.long().flatten()
        if idx.numel() == 0:
            return 0, idx
        idx = torch.where(idx < 0, idx + n, idx)
        if bool((idx < 0).any() or (idx >= n).any()):
            raise ValueError(f"logits_to_keep indices must lie within the {n} new tokens")
        need = n - int(idx.min())
        return need, idx - (n - need)
    k = n if logits_to_keep == 0 else min(int(logits_to_keep), n)
    return k, slice(-k, None)


class CEDModel(nn.Module):
    """The original causal LM (`base`, unchanged) + the decoder layers' projections."""

    def __init__(self, base, projections: Projections, split: int, n_win: int):
        super().__init__()
        self.base, self.projections = base, projections
        self.split, self.n_win = split, n_win
        text = self.config.get_text_config(decoder=True)
        self.text_config = text
        self.inner = base.model
        rotary = self.inner.rotary_emb
        self._typed_rope = "layer_type" in inspect.signature(rotary.forward).parameters
        self._types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)

    @property
    def config(self):
        return self.base.config

    @property
    def generation_config(self):
        return self.base.generation_config

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    def set_attn_implementation(self, name: str) -> None:
        self.base.set_attn_implementation(name)

    def _rope(self, h: torch.Tensor, pos: torch.Tensor) -> dict:
        return rope_tables(self.inner.rotary_emb, h, pos, set(self._types), self._typed_rope)

    def forward(
        self,
        input_ids: torch.LongTensor,
        cache: CompressedCache | None = None,
        past_key_values: CompressedCache | None = None,
        use_cache: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = CompressedCache(self.config, "bf16", fused=False)
        if getattr(cache, "ced", None) is None:
            raise ValueError("an encoder-decoder model runs over a CompressedCache made from its own config")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("an encoder-decoder model takes no padding (rows of one length)")
        b, n = input_ids.shape
        start = cache.get_seq_length()
        pos = torch.arange(start, start + n).unsqueeze(0)
        if position_ids is not None and not torch.equal(position_ids.expand(b, n), pos.expand(b, n)):
            raise ValueError("an encoder-decoder model reads positions from its cache (no position_ids)")
        h = self.inner.embed_tokens(input_ids)
        rope = self._rope(h, pos)
        args = dict(
            config=self.text_config, inputs_embeds=h, attention_mask=None, cache=cache, position_ids=pos
        )
        masks = {"full_attention": create_causal_mask(**args)}
        if "sliding_attention" in self._types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        for i in range(self.split):
            t = self._types[i]
            h = self.inner.layers[i](
                h,
                attention_mask=masks[t],
                position_embeddings=rope[t],
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
        if cache.hidden is not None:  # the store keeps H(split): the decoder half runs on it as held
            h = cache.hidden.hold(h, start)
        self._project(cache, h, rope)
        return self._decode(cache, h, start, n, logits_to_keep)

    def _project(self, cache: CompressedCache, h: torch.Tensor, rope: dict) -> None:
        """Add every decoder layer's projected K/V of the rows `h` (RoPE tables at their positions)."""
        x = rms(h)
        for j, i in enumerate(range(self.split, len(self.inner.layers))):
            k, v = self.projections(x, j)
            cos, sin = rope[self._types[i]]
            cache.layers[i].add_projected(rotate(k, cos, sin), v)

    @torch.inference_mode()
    def project_held(self, cache: CompressedCache, upto: int, block: int) -> None:
        """After `H(split)` of positions `[0, upto)` was installed from the store (`cache.hidden`): the
        decoder layers' projected K/V made from it block by block, sealed after each block, as the
        cold run's chunks made them (a prefill chunk limit under `block` would cut them otherwise)."""
        for a in range(0, upto, block):
            h = cache.hidden.rows(a, min(block, upto - a))
            self._project(cache, h, self._rope(h, torch.arange(a, a + h.shape[1]).unsqueeze(0)))
            seal(cache, block)

    def held_rows(self, cache: CompressedCache, upto: int) -> tuple[int, torch.Tensor] | None:
        """The decoder's pending rows as a cold run leaves them at `upto`: `H(split)` of the last
        `n_win` positions before it, as held."""
        first = max(0, upto - self.n_win)
        return (first, cache.hidden.rows(first, upto - first)) if upto else None

    def _decode(self, cache: CompressedCache, h: torch.Tensor, start: int, n: int, logits_to_keep):
        """Run the decoder over the rows it owes (or only remember them when no logits are asked)."""
        need, pick = logit_rows(logits_to_keep, n)
        rows, first = h, start
        if cache.pending is not None:
            first, old = cache.pending
            rows = torch.cat([old, h], dim=1)
        cache.pending = None
        if need == 0:
            cache.pending = (first + max(0, rows.shape[1] - self.n_win), rows[:, -self.n_win :])
            cache.settle()
            vocab = self.base.lm_head.out_features
            return CausalLMOutputWithPast(logits=h.new_zeros(h.shape[0], 0, vocab), cache=cache)
        r = max(min(rows.shape[1], self.n_win), need)
        q0 = start + n - r
        h = rows[:, -r:]
        pos = torch.arange(q0, q0 + r).unsqueeze(0)
        rope = self._rope(h, pos)
        for i in range(self.split, len(self.inner.layers)):
            layer = cache.layers[i]
            layer.prepare(q0, r)
            t = self._types[i]
            h = self.inner.layers[i](
                h,
                attention_mask=layer.mask(q0, r, h.dtype),
                position_embeddings=rope[t],
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
        cache.settle()
        logits = head_logits(self.base, self.inner.norm(h[:, -need:][:, pick]))
        return CausalLMOutputWithPast(logits=logits, cache=cache)


def encoder_decoder(
    base, projections: Projections, split: int, n_win: int, store: str = STORED[0]
) -> CEDModel:
    """`base` as an encoder-decoder: its config takes the split, window and what the store keeps (so
    every `CompressedCache` made from it holds projected decoder layers); `base` itself is taken over."""
    setattr(base.config.get_text_config(decoder=True), CONFIG_KEY, ced_config(split, n_win, store))
    return CEDModel(base, copy.deepcopy(projections).to(base.dtype), split, n_win).eval()


def decoder_shape(config) -> tuple[int, int, int, int]:
    """(hidden size, KV heads, head_dim, layers) of a config: what `Projections` needs."""
    text = config.get_text_config(decoder=True)
    return text.hidden_size, text.num_key_value_heads, head_dim(text), text.num_hidden_layers
