"""Real `kvstrata serve` processes on 127.0.0.1 (free ports) and the official `openai` client."""

import threading
import time
from pathlib import Path

import openai
import torch

from kvstrata.hf.run import eos_ids
from kvstrata.names import Retention
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.serve.metrics import Metrics
from kvstrata.serve.sampling import Sampling
from kvstrata.serve.scheduler import Limits
from kvstrata.serve.sessions import Sessions
from kvstrata.serve.worker import Finished, Job, TextDelta, Worker
from kvstrata.serve.write_behind import WriteBehindStore
from kvstrata_lab.serve_bench.process import ServerProcess

BLOCK = 16  # tokens per block: small, so short prompts span several
# an SWA miss replays the tiny Gemma-3's receptive field (`--replay-tokens exact`: 15 tokens before
# each of its 3 sliding layers' windows, a block less one for the full layer below the last one), so
# a replayed answer is the cold run's
REPLAY, REPLAYED = "exact", 3 * 15 + BLOCK - 1


def replay_start(held: int) -> int:
    """Where a replay of a `held`-token cached prefix starts: the block boundary at or before the
    receptive field (the cold run's chunks start there)."""
    return max(0, held - REPLAYED) // BLOCK * BLOCK


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


def apart_at(got: list[int], want: list[int]) -> int | None:
    """The first step where two greedy answers differ (None: equal)."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


# --- the worker in-process (batched vs unbatched) -------------------------------------------------
STORE_BLOCK = 8


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Harness:
    """A worker over a fresh disk store; `ask` submits and returns a handle to wait on."""

    def __init__(self, model, method, tmp, limits: Limits):
        self.store = WriteBehindStore(DiskTier(tmp / "g", 1 << 26), MemoryTier(1 << 24), swa_ttl_s=300)
        sessions = Sessions(model, method, self.store, block_size=STORE_BLOCK, replay_tokens="exact")
        self.worker = Worker(model, sessions, lambda ids: ",".join(map(str, ids)), eos_ids(model), 4096,
                             Metrics(self.store), limits)
        self.worker.start()

    def ask(self, ids: list[int], max_tokens: int) -> dict:
        got: dict = {"deltas": 0, "done": threading.Event()}

        def emit(event):
            if isinstance(event, TextDelta):
                got["deltas"] += 1
            else:
                got["event"] = event
                got["done"].set()

        job = Job(ids=ids, max_tokens=max_tokens, sampling=Sampling(), stops=(), tenant=b"",
                  retention=Retention.PERSISTENT, deadline=time.monotonic() + 300, emit=emit)
        self.worker.submit(job)
        got["job"] = job
        return got

    def cancel(self, handle: dict) -> None:
        handle["job"].cancelled.set()

    def close(self):
        self.worker.stop()
        self.store.close()


def answer(handle: dict) -> tuple[str, str]:
    assert handle["done"].wait(300)
    event = handle["event"]
    assert isinstance(event, Finished), event
    return event.outcome.text, event.outcome.kind


def scenario_requests() -> list[list[tuple[list[int], int]]]:
    """`scenario`'s requests (prompt ids, max tokens), phase by phase: misses, hits on longer prompts,
    replays of those after the SWA pool is emptied."""
    misses = [(prompt(1, 45), 14), (prompt(2, 60), 3), (prompt(3, 21), 9), (prompt(4, 5), 6)]
    hits = [(prompt(s, n) + prompt(s + 10, 7), 8) for s, n in ((1, 45), (2, 60), (3, 21))]
    replays = [(prompt(s, n) + prompt(s + 10, 7) + [9], 5) for s, n in ((1, 45), (2, 60))]
    return [misses, hits, replays]


CHUNK = 16  # scenario's prefill chunk


def scenario(model, method, tmp, batching: bool) -> list[tuple[str, str]]:
    """Misses (one joining while another decodes, one leaving early), hits on longer prompts, then
    replays after the SWA pool is emptied -- the same requests in the same order for both workers."""
    h = Harness(model, method, tmp, Limits(max_running=8, max_batched_tokens=40, prefill_chunk=CHUNK,
                                           batching=batching))
    misses, hits, replays = scenario_requests()
    try:
        out = []
        a = h.ask(*misses[0])
        while a["deltas"] < 3 and not a["done"].is_set():
            time.sleep(0.001)
        rest = [h.ask(*r) for r in misses[1:]]
        out += [answer(x) for x in [a, *rest]]
        assert h.store.flush()
        out += [answer(x) for x in [h.ask(*r) for r in hits]]
        assert h.store.flush()
        h.store.swa_tier._data.clear()
        out += [answer(x) for x in [h.ask(*r) for r in replays]]
        return out
    finally:
        h.close()


class Ids:
    """A tokenizer stand-in for `generate`: token ids as their own text."""

    pad_token_id, eos_token_id = 0, None

    def decode(self, ids, skip_special_tokens=True):
        return ",".join(map(str, ids))


def generated(model, ids: list[int], method: str, max_tokens: int, **cuts) -> tuple[list[int], list[float]]:
    """`kvstrata generate`'s greedy tokens as a server's answer holds them (without a final EOS) and
    each one's lead over the runner-up."""
    from kvstrata.hf.run import generate

    ref = generate(model, Ids(), torch.tensor([ids]), method, max_tokens, **cuts)
    stop = ref.new_tokens[-1:] and ref.new_tokens[-1] in eos_ids(model)
    return ref.new_tokens[:-1] if stop else ref.new_tokens, ref.margins


def generate_disagreements(model, method, answers: list[tuple[str, str]]) -> list[tuple[str, int, float]]:
    """`scenario`'s answers that are not `kvstrata generate`'s (cut as the scenario's server cuts: its
    chunk and store block): (kind, first differing token, generate's lead over its runner-up there)
    each."""
    out = []
    for (ids, m), (text, kind) in zip([r for phase in scenario_requests() for r in phase], answers):
        want, leads = generated(model, ids, method, m, prefill_chunk=CHUNK, store_block=STORE_BLOCK)
        got = [int(t) for t in text.split(",")] if text else []
        if (i := apart_at(got, want)) is not None:
            out.append((kind, i, leads[i] if i < len(leads) else 0.0))
    return out
