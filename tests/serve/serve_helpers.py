"""Real `kvstrata serve` processes on 127.0.0.1 (free ports) and the official `openai` client."""

from pathlib import Path

import openai
import torch

from kvstrata_lab.serve_bench.process import ServerProcess

BLOCK = 16  # tokens per block: small, so short prompts span several
# an SWA miss replays the tiny Gemma-3's receptive field (`--replay-tokens exact`: 3 sliding layers x
# 15 tokens before each one's window), so a replayed answer is the cold run's
REPLAY, REPLAYED = "exact", 45


def start_server(
    model_dir: str, tmp: Path, *args: str, env: dict | None = None, name: str = "tiny"
) -> ServerProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"KVSTRATA_STORE_ROOT": str(tmp / "store"), "KVSTRATA_STORE_BLOCK_SIZE": str(BLOCK), **(env or {})}
    return ServerProcess(
        model_dir, "--replay-tokens", REPLAY, *args, env=env, name=name, log_path=tmp / "server.log"
    ).start()


def client(server: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def greedy_reference(model, tok, ids: list[int], max_tokens: int) -> str:
    """What `kvstrata generate` answers for these prompt ids (bf16 cache, greedy)."""
    from kvstrata.hf.run import generate

    return generate(model, tok, torch.tensor([ids]), "bf16", max_new_tokens=max_tokens).text


def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def text_of(n: int, seed: int = 0) -> str:
    """`n` characters of varied ASCII text (one token each under the tiny models' byte tokenizer)."""
    words = "the store keeps every block of global key value cache across turns and restarts".split()
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(" ".join(out)) < n:
        out.append(words[int(torch.randint(len(words), (1,), generator=g))])
    return " ".join(out)[:n]
