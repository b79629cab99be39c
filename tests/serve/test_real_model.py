"""SmolLM2-135M-Instruct through a real server: a two-turn chat whose second turn is served from the
store, each greedy answer equal to `kvstrata generate`'s for the same templated prompt; and the
batched worker's answers equal the unbatched worker's and `kvstrata generate`'s on it, lossy codecs
included (misses, hits, requests joining and leaving mid-batch)."""

import pytest
from serve_helpers import (
    BLOCK,
    chat_ids,
    client,
    generate_disagreements,
    greedy_reference,
    scenario,
    start_server,
)

from kvstrata.methods import METHODS
from kvstrata.models import KNOWN_MODELS, load

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"


def test_smollm2_chat_round_trip_hits_on_the_second_turn(tmp_path):
    if not KNOWN_MODELS[MODEL].installed():
        pytest.fail(f"{MODEL} missing: {KNOWN_MODELS[MODEL].install_command}")
    model, tok = load(MODEL)
    server = start_server(MODEL, tmp_path, name=MODEL)
    try:
        oa = client(server)
        messages = [{"role": "system", "content": "You answer in one short sentence. " * 4},
                    {"role": "user", "content": "What is the capital of France?"}]
        first = 0
        for turn in range(2):
            got = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            answer = got.choices[0].message.content
            assert answer == greedy_reference(model, tok, chat_ids(tok, messages), 12)
            assert got.kvstrata["kind"] == ("miss", "hit")[turn]
            if turn:  # every whole block of the first turn's prompt (its last token is always run)
                assert got.usage.prompt_tokens_details.cached_tokens == (first - 1) // BLOCK * BLOCK > 0
            first = got.usage.prompt_tokens
            messages += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "And of Italy?"}]
        assert "Paris" in messages[2]["content"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def smollm2():
    if not KNOWN_MODELS[MODEL].installed():
        pytest.fail(f"{MODEL} missing: {KNOWN_MODELS[MODEL].install_command}")
    return load(MODEL)[0]


LSQ = "int4:keys=channel,group=96,r=0,v=nvfp4,fit=lsq,sink=4,rot=hadamard"
CODECS = [n for n, e in METHODS.items() if e.stratum == "store"]  # bf16, fp8, the 4-, 3- and 2-bit ones


@pytest.mark.parametrize("method", [*CODECS, LSQ])
def test_smollm2_batched_answers_equal_unbatched_ones_and_generates(method, smollm2, tmp_path):
    batched = scenario(smollm2, method, tmp_path / "b", True)
    assert batched == scenario(smollm2, method, tmp_path / "u", False)
    assert generate_disagreements(smollm2, method, batched) == []
