"""`load(name_or_path)`: (model, tokenizer) for a known real model, a tiny test model or a local HF directory.

A known model's GGUF is dequantized once into a safetensors copy under the cache directory
(`KVSTRATA_CACHE`, default `~/.cache/kvstrata`); later loads read that copy. A tiny model
(`tiny-llama`, `tiny-gemma3`) is written there on first use, and rewritten when its definition
changes. Nothing touches a hub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvstrata.hf import linear
from kvstrata.hf.cache import check_fits_model
from kvstrata.hf.projected import ced_plan
from kvstrata.methods import MethodSpec, check_store, parse_method, render_recipe
from kvstrata.models.catalog import KNOWN_MODELS, TINY_MODELS, unknown_model
from kvstrata.models.ced.store import wrap
from kvstrata.models.tiny import save_tiny, tiny_config
from kvstrata.settings import DTYPES

COMPLETE_MARK = "kvstrata-converted.ok"
#: bumped when what a converted directory holds changes: an older directory is converted again
#: (2: tied weights stored under the name they are tied to, `architectures` in config.json)
CONVERTED_FORMAT = 2


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE", Path.home() / ".cache" / "kvstrata"))


def set_threads() -> None:
    """Use every core for torch's CPU kernels."""
    torch.set_num_threads(os.cpu_count() or 1)


def converted_path(name: str) -> Path:
    return cache_dir() / "models" / name


def install_dir(target: Path, write: Callable[[Path], str]) -> Path:
    """Fill `target` atomically: `write(tmp)` fills a temporary directory and returns the completion
    mark's text; the directory then replaces `target`, so a half-written copy is never used."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        (tmp / COMPLETE_MARK).write_text(write(tmp))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(name: str) -> Path:
    """Dequantize the GGUF once into safetensors."""
    known = KNOWN_MODELS[name]
    gguf = known.gguf_path(cache_dir() / "gguf")
    gguf.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> str:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers marks GGUF-loaded models as quantized and refuses save_pretrained, although
        # the weights are already dequantized: write config + safetensors ourselves.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(standard_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        return _mark(gguf)

    return install_dir(converted_path(name), write)


def is_converted(name: str) -> bool:
    """Whether known model `name` has a complete converted directory of the current format."""
    mark = converted_path(name) / COMPLETE_MARK
    try:
        return mark.read_text().startswith(f"format {CONVERTED_FORMAT} ")
    except OSError:
        return False


def _mark(gguf: Path) -> str:
    return f"format {CONVERTED_FORMAT} {gguf}"


def standard_tensors(model) -> dict[str, torch.Tensor]:
    """The weights as every engine reads them: a tied weight once, under the name it is tied to
    (`model.embed_tokens.weight`, not `lm_head.weight`: an engine that reads the tie from the config
    fills the embedding from that name and leaves a stray head name unused)."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.get_text_config().tie_word_embeddings:
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            if source in tensors and target in tensors:
                del tensors[target]
    return tensors


def _tiny(name: str) -> Path:
    """A tiny model's directory, written on first use and whenever its definition changed."""

    arch = TINY_MODELS[name].arch
    stamp = "tiny " + hashlib.sha256(tiny_config(arch).to_json_string().encode()).hexdigest()
    target = converted_path(name)
    mark = target / COMPLETE_MARK
    if mark.exists() and mark.read_text() == stamp:
        return target

    def write(tmp: Path) -> str:
        save_tiny(tmp, arch)
        return stamp

    return install_dir(target, write)


def check(name_or_path: str) -> None:
    """Raise a clear error unless `name_or_path` is a known model or a local model directory
    (cheap: converts nothing, so a long run can check its models before it starts)."""
    why = unknown_model(name_or_path)
    if why:
        raise FileNotFoundError(why)


def resolve(name_or_path: str) -> Path:
    """Directory to load from: a converted known model (converting on first use), a tiny model
    (written on first use) or a local dir."""
    check(name_or_path)
    key = name_or_path.lower()
    if key in TINY_MODELS:
        return _tiny(key)
    if key not in KNOWN_MODELS:
        return Path(name_or_path).expanduser()
    return converted_path(key) if is_converted(key) else _convert(key)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`float32` / `bf16` (`kvstrata.settings.DTYPES`) as a torch dtype; a torch dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    named = {"float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if dtype not in named:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return named[dtype]


def load(name_or_path: str, dtype: str | torch.dtype = torch.float32):
    """(model, tokenizer) in eval mode; offline only. `dtype`: the weights' and activations' type."""
    path = resolve(name_or_path)
    return load_model(path, dtype), load_tokenizer(path)


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = torch.float32):
    """The model alone, in eval mode (for a command that checked its input with the tokenizer and the
    config first: loading the weights is the slow part)."""
    set_threads()
    path = resolve(str(name_or_path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), local_files_only=True)
    model.eval()
    linear.install(model)  # a decode step's linears through the batch-invariant kernel (`kvstrata.hf.linear`)
    if ced_plan(model.config.get_text_config(decoder=True)) is not None:
        return wrap(model, path)  # an encoder-decoder directory (`kvstrata.models.ced.store`)
    return model


def load_config(name_or_path: str | Path):
    """The model's transformers config, from its config.json alone (no weights are read)."""
    return AutoConfig.from_pretrained(resolve(str(name_or_path)), local_files_only=True)


def check_method(name_or_path: str, text: str, store: bool = False) -> MethodSpec:
    """The method spec `text`, parsed, then refused unless it fits the model's shape (and, with `store`,
    unless the persistent store can hold it): from the config alone, so before any weights load."""
    spec = parse_method(text)
    if store:
        check_store(spec)
    config = load_config(name_or_path)
    classes = check_fits_model(spec, config)
    if spec.sliding != spec.full and not any(c == "sliding" for c, _ in classes):
        print(f"kvstrata: warning: {text!r} gives sliding-window layers a recipe of their own, but "
              f"{name_or_path} has none: every layer runs {render_recipe(spec.full)!r}", file=sys.stderr)
    return spec


def refuse_encoder_decoder(name_or_path: str, what: str) -> None:
    """One clear line where a command cannot run an encoder-decoder directory yet (from its config)."""
    if ced_plan(load_config(name_or_path).get_text_config(decoder=True)) is not None:
        raise ValueError(f"{name_or_path} is an encoder-decoder (kvstrata retrofit): {what} does not run "
                         "one yet (kvstrata generate does)")


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer alone (the model's directory is prepared as `resolve` does; no weights are read)."""
    return AutoTokenizer.from_pretrained(resolve(str(name_or_path)), local_files_only=True)
