"""Tiny randomly initialised models of the real models' architectures, for fast tests.

`tiny_model("llama")` mirrors SmolLM2 (GQA, full attention); `tiny_model("gemma3")` mirrors
Gemma 3 (sliding-window layers with global layers between). `save_tiny(dir)` writes one to disk
with a byte-level tokenizer (and, on request, a chat template) so that everything that loads a
model directory can use it, e.g. `kvstrata serve --model DIR`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, PreTrainedTokenizerFast

ARCHES = ("llama", "gemma3")

#: a ChatML-like template over plain text, for serving tests of /v1/chat/completions
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt "
    "%}<|assistant|>{% endif %}"
)


def tiny_config(arch: str = "llama"):

    common = dict(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )
    raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(ARCHES)})")


def tiny_model(arch: str = "llama", seed: int = 0):
    """A randomly initialised causal LM in float32, eval mode, eager attention."""

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def byte_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes; 256 <s>, 257 </s>, 258 <pad>."""

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return fast


def _byte_of(ch: str) -> int:
    """Inverse of the GPT-2 bytes-to-unicode map for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
              list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(ch))]


def save_tiny(path: str | Path, arch: str = "llama", seed: int = 0, chat_template: bool = False) -> Path:
    """Write a tiny model + tokenizer as a local HF model directory (with `CHAT_TEMPLATE` if asked)."""
    path = Path(path)
    tiny_model(arch, seed).save_pretrained(path)
    tok = byte_tokenizer()
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path
