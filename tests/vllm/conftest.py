"""The model and prompt the connector's engine tests share: SmolLM2-135M and 300 tokens of our docs."""

from pathlib import Path

import pytest

from kvstrata.models.loader import load_tokenizer, resolve

TEXT = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()[:1400]


@pytest.fixture(scope="module")
def model_and_prompt():
    model = resolve("smollm2-135m")
    ids = load_tokenizer(model)(TEXT)["input_ids"][:300]
    assert len(ids) == 300
    return str(model), ids
