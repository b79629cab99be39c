"""Fixtures: the tiny model directories (`model_dirs`, tests/conftest.py) loaded in-process for
reference answers, and one shared server. Helpers live in serve_helpers.py."""

import pytest
from serve_helpers import start_server


@pytest.fixture(scope="session")
def loaded(model_dirs):
    """The same model directories loaded in this process (the reference side of comparisons)."""
    from kvstrata.models import load

    return {name: load(path) for name, path in model_dirs.items()}



@pytest.fixture(scope="session")
def gemma_server(model_dirs, tmp_path_factory):
    """One server for the round-trip and bad-input modules: tiny Gemma-3 (sliding + global layers),
    disk store."""
    s = start_server(model_dirs["gemma"], tmp_path_factory.mktemp("gemma-server"))
    yield s
    s.stop()
