import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton's kernels run in its CPU interpreter here; the flag must be set before anything imports
# triton (optimum-quanto and hqq do, on import)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(os.cpu_count() or 1)


@pytest.fixture(scope="session")
def tiny_llama():
    from kvstrata.models.tiny import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma():
    from kvstrata.models.tiny import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny Gemma-3 with a chat template, tiny Llama without one, saved as model directories (what
    `kvstrata serve --model DIR` loads)."""
    from kvstrata.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("models")
    return {"gemma": str(save_tiny(root / "tiny-gemma", "gemma3", chat_template=True)),
            "llama": str(save_tiny(root / "tiny-llama", "llama"))}
