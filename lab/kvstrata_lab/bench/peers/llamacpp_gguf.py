"""The GGUF file llama.cpp runs for one of our models.

A known model: the very GGUF our converted directory was made from (its quantized weights). A tiny
Llama with our byte tokenizer (`tiny-llama`, or a directory `save_tiny` wrote): written here from
its weights in float32 and cached, so the tests run llama.cpp on a model they made themselves.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import torch

from kvstrata.models.catalog import KNOWN_MODELS
from kvstrata.models.loader import cache_dir, load_config, load_model, load_tokenizer, resolve

NORMAL, CONTROL, UNKNOWN = 1, 3, 2  # llama.cpp's token types
FORMAT = 3  # of the GGUF written here (in its file name: a new layout is written anew)


def gguf_for(model_name: str) -> Path:
    """The GGUF llama.cpp loads for `model_name`; ValueError (one line) when there is none."""
    if model_name in KNOWN_MODELS:
        return KNOWN_MODELS[model_name].gguf_path(cache_dir() / "gguf")
    path = resolve(model_name)
    config = load_config(path)
    tok = load_tokenizer(path)
    if config.model_type != "llama" or len(tok) > 512 or tok.convert_ids_to_tokens(65) != "A":
        raise ValueError(f"llama.cpp peer: no GGUF for {model_name!r} (the known models run their package's "
                         "GGUF; a Llama with kvstrata's byte tokenizer is written on the fly)")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.glob("*.safetensors")))).hexdigest()
    target = cache_dir() / "gguf" / f"{path.name}-{digest[:16]}-f32-v{FORMAT}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        write_llama(path, target.with_suffix(".part"))
        target.with_suffix(".part").replace(target)
    return target


def weights(gguf_path: Path) -> str:
    """The weights' type as the file says (`Q4_1`, `Q4_K_M`, `F32`)."""
    field = gguf.GGUFReader(gguf_path).fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _rope_pairs(w: torch.Tensor, heads: int) -> np.ndarray:
    """Rows of a Q or K projection reordered from transformers' half-split rotary layout to
    llama.cpp's adjacent pairs."""
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).transpose(1, 2).reshape(out, inp).numpy()


def write_llama(model_dir: Path, target: Path) -> None:
    """A float32 GGUF of a Llama with the byte tokenizer (ids 0..255 bytes, then specials)."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    w = gguf.GGUFWriter(str(target), "llama")
    w.add_name(model_dir.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    special = {tok.bos_token_id: CONTROL, tok.eos_token_id: CONTROL, tok.pad_token_id: CONTROL}
    # byte-level BPE with no merges, as our tokenizer is: text tokenizes to the same ids on both sides
    tokens = [tok.convert_ids_to_tokens(i) or f"<unused{i}>" for i in range(c.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    # llama.cpp wants a merge list; one between two specials never fires (text splits into single bytes)
    w.add_token_merges([f"{tok.bos_token} {tok.eos_token}"])
    w.add_token_types([NORMAL if i < 256 else special.get(i, UNKNOWN) for i in range(c.vocab_size)])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_unk_token_id(next(i for i in range(256, c.vocab_size) if i not in special))
    w.add_add_bos_token(bool(tok("a").input_ids[0] == tok.bos_token_id))
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
        for ours, theirs, heads in (("attn_q", "q_proj", c.num_attention_heads),
                                    ("attn_k", "k_proj", c.num_key_value_heads)):
            w.add_tensor(f"blk.{i}.{ours}.weight", _rope_pairs(sd[f"{p}self_attn.{theirs}.weight"], heads))
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
