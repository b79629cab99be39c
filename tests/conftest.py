import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(os.cpu_count() or 1)


@pytest.fixture(scope="session")
def tiny_llama():
    from kvstrata.models.tiny import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma():
    from kvstrata.models.tiny import tiny_model

    return tiny_model("gemma3")
