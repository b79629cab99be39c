"""CLI smoke matrix: every subcommand with its documented example and a few other sizes (lengths
that are and are not multiples of the store's 256-token block and of the codecs' 16/32-value
blocks, 1k and 4k), on the built-in tiny models where a real one is too slow. Each case asserts
the exit code and something real in what the command printed or wrote, so a documented command
that crashes at another size is caught. Real-model cases are marked `integration`."""

import json
import shlex
from pathlib import Path

import pytest

from kvstrata.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TURNS = ROOT / "docs" / "examples" / "agent_turns.txt"


@pytest.fixture(autouse=True)
def store_root(tmp_path, monkeypatch):
    """Commands that use the persistent store write under the test's own directory."""
    monkeypatch.setenv("KVSTRATA_STORE_ROOT", str(tmp_path / "store"))


def run(capsys, command: str, stream: str = "out") -> str:
    """Run `kvstrata COMMAND` in process; its stdout (or stderr), exit code 0 asserted."""
    code = main(shlex.split(command))
    out, err = capsys.readouterr()
    assert code == 0, f"kvstrata {command} exited {code}: {err[-2000:]}"
    return out if stream == "out" else err


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_subcommand_is_in_this_matrix():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    tests = " ".join(name for name in globals() if name.startswith("test_"))
    assert [s for s in subcommands if s.replace("-", "_") not in tests] == []


def test_models_and_methods(capsys):
    out = run(capsys, "models")
    assert "tiny-llama" in out and "tiny-gemma3" in out and "smollm2-135m" in out
    out = run(capsys, "methods")
    assert "nvfp4" in out and "snapkv" in out and "topk" in out


@pytest.mark.parametrize(
    "model, method, tokens",
    [
        ("tiny-llama", "nvfp4:r=64", 1000), ("tiny-gemma3", "nvfp4;sliding=fp8", 4096),
        # keep policies take their scores from the prefill through the attention hook, outside the bench
        ("tiny-llama", "snapkv:keep=0.28", 1000), ("tiny-gemma3", "tova:keep=0.5+nvfp4:rot=hadamard", 3000),
    ],
)
def test_generate(capsys, tmp_path, model, method, tokens):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(("There and back again. " * 200)[:tokens])  # one token per byte
    row = json.loads(
        run(
            capsys,
            f"generate --model {model} --method '{method}' --prompt-file {prompt} --max-new-tokens 4 --json",
        )
    )
    assert row["method"] == method and row["context_tokens"] == tokens
    assert row["new_tokens"] >= 1 and row["kv_bytes_per_token"] < row["kv_bytes_per_token_bf16"]
    assert "context 11 tokens; KV" in run(
        capsys, f"generate --model {model} --prompt 'hello there' --max-new-tokens 2", "err"
    )


@pytest.mark.parametrize(
    "model, tokens",
    [("tiny-llama", 1000), ("tiny-llama", 1024), ("tiny-gemma3", 3000), ("tiny-gemma3", 4096)],
)
def test_passkey(capsys, model, tokens):
    out = run(capsys, f"passkey --model {model} --tokens {tokens}")
    assert out.startswith(f"{model}: {tokens} tokens, needle ")  # the length asked is the length fed
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["bf16", "nvfp4", "mxfp4"]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """`kvstrata bench` at 1000 and 1024 tokens (tiny Gemma-3, every task) and 4096 (tiny Llama)."""
    out = tmp_path_factory.mktemp("bench")
    for model, tasks in (
        ("tiny-gemma3@1000/1024", "single,multikey,multivalue,multiquery,vartrack,fidelity"),
        ("tiny-llama@4096", "single,fidelity"),
    ):
        assert (
            main(
                shlex.split(
                    f"bench --model {model} --n 1 --tasks {tasks} --methods bf16,nvfp4,snapkv:keep=0.28 "
                    f"--out {out}"
                )
            )
            == 0
        )
    return out


def test_bench_rows_run_at_their_length(bench_dir):
    rs = rows(bench_dir / "results.jsonl")
    assert {(r["model"], r["length"]) for r in rs} == {
        ("tiny-gemma3", 1000), ("tiny-gemma3", 1024), ("tiny-llama", 4096),
    }
    assert len(rs) == 3 * (6 + 6 + 2)
    for r in rs:
        if r["task"] == "fidelity":
            assert r["context_tokens"] == r["length"] and r["question_tokens"] == 0
        else:
            assert r["context_tokens"] + r["question_tokens"] == r["length"] and r["output"] is not None


def test_report(bench_dir, capsys):
    out = run(capsys, f"report {bench_dir}")
    md = Path(out.strip()).read_text()
    assert "### tiny-gemma3, 1024 tokens (1 instances per task)" in md and "| `nvfp4` |" in md
    assert "Contexts fed:" in md and "4,096 tokens before the continuation (fidelity)" in md
    assert (bench_dir / "report.html").read_text().startswith("<!doctype html>")


def test_check_lengths_finds_and_drops_a_short_row(bench_dir, tmp_path, capsys):
    assert run(capsys, f"check-lengths {bench_dir}").endswith(
        "0 of 42 rows were fed a context their nominal length does not allow\n"
    )
    work = tmp_path / "copy"
    work.mkdir()
    rs = rows(bench_dir / "results.jsonl")
    legacy = {k: v for k, v in rs[0].items() if k not in ("question_tokens", "special_tokens")}
    legacy["context_tokens"] -= 100  # as rows written before the lengths were exact
    (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [legacy, *rs[1:]]))
    out = run(capsys, f"check-lengths {work} --drop")
    assert (
        f"| {legacy['model']} | {legacy['length']} | {legacy['task']} | `{legacy['method']}` | 1 (0) |" in out
    )
    assert "1 of 42 rows" in out
    assert len(rows(work / "results.jsonl")) == 41 and rows(work / "short-rows.jsonl") == [legacy]
    out = run(capsys, f"check-lengths {work}")
    assert "0 of 41 rows" in out
    assert "0 of the 1 rows in short-rows.jsonl have been rerun at their length; 1 have not" in out
    r = legacy
    assert f"| {r['model']} | {r['length']} | `{r['method']}` | {r['task']} | 0 | 1 |" in out
    with (work / "results.jsonl").open("a") as f:  # the rerun, at its length
        f.write(json.dumps(rs[0]) + "\n")
    assert run(capsys, f"check-lengths {work}").endswith(
        "1 of the 1 rows in short-rows.jsonl have been rerun at their length\n"
    )


@pytest.mark.parametrize(
    "command, words",
    [
        ("accounting --preset v41-flash", "890"),
        ("accounting --model tiny-llama --method nvfp4 --tokens 4096", "nvfp4"),
        ("accounting --model tiny-gemma3 --method mxfp4 --tokens 1000 --json", '"layers"'),
    ],
)
def test_accounting(capsys, command, words):
    assert words in run(capsys, command)


def test_store(capsys, tmp_path):
    for action in ("stats", "verify", "gc"):
        assert isinstance(json.loads(run(capsys, f"store {action}")), dict)


@pytest.mark.parametrize("tokens", [8192, 4096, 3000, 1000])
def test_store_bench(capsys, tmp_path, tokens):
    """The documented 8k, the 4k and 3k that crashed on Gemma-3 (an empty continuation), and 1k."""
    result = json.loads(run(capsys, f"store-bench --model tiny-gemma3 --tokens {tokens} --out {tmp_path}"))
    assert result["tokens"] == tokens and [r["windows"] for r in result["replay"]] == [1, 2, 4]
    assert result["warm_vs_exact"]["top1"] == 1.0 and result["ttft"]["cold_s"] > 0
    assert json.loads((tmp_path / "store_evidence.json").read_text())["tokens"] == tokens


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-llama"])
def test_replay_check(capsys, tmp_path, model):
    """`kvstrata replay-check` on a tiny model: every mode of the sliding model (hit, bounded 1/2/4
    windows, exact: 3 sliding layers x 15 tokens and a block less one for the full layer below the
    last, from a block boundary) and only the hit of the full-attention one; a hit and an exact
    replay answer as the cold run did; the JSON and the table with its command."""
    out = run(capsys, f"replay-check --model {model} --prompts 2 --tokens 200 --splits 2 --turn-tokens 9 "
                      f"--new-tokens 3 --block 32 --out {tmp_path}")
    result = json.loads((tmp_path / "replay_check.json").read_text())
    summary = result["summary"]
    sliding = model == "tiny-gemma3"
    modes = ["hit", "bounded 1w", "bounded 2w", "bounded 4w", "exact"] if sliding else ["hit"]
    assert list(summary) == modes
    assert len(result["rows"]) == 4 * len(summary) and result["exact_tokens"] == (45 + 31 if sliding else 0)
    for mode in ("hit", "exact") if sliding else ("hit",):
        assert summary[mode]["same_greedy"] == 1.0 and summary[mode]["kl_max"] < 1e-6
    starts = [max(0, r["reused"] - r["n_win"]) // 32 * 32 for r in result["rows"]]  # block boundaries
    assert all(r["replayed"] == r["reused"] - s for r, s in zip(result["rows"], starts))
    assert "| exact |" in out if sliding else "no sliding layers" in out
    assert "kvstrata replay-check --model" in (tmp_path / "replay_check.md").read_text()


def test_store_bench_refuses_a_prompt_under_one_block(capsys, tmp_path):
    assert main(["store-bench", "--model", "tiny-gemma3", "--tokens", "200", "--out", str(tmp_path)]) == 2
    assert "longer than one 256-token block" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", [1000, 2048])
def test_depth_similarity(capsys, tmp_path, tokens):
    out = run(capsys, f"depth-similarity --model tiny-llama,tiny-gemma3 --tokens {tokens} --out {tmp_path}")
    assert "tiny-llama: mean adjacent cosine K" in out and "tiny-gemma3:" in out
    r = json.loads((tmp_path / "depth_similarity.json").read_text())
    assert r["tiny-llama"]["tokens"] == tokens and (tmp_path / "depth_tiny-gemma3.png").exists()


def test_depth_ablation(capsys, tmp_path):
    out = run(capsys, f"depth-ablation --model tiny-llama --length 1000 --n 1 --out {tmp_path}")
    assert "## FreqDepthKV ablation" in out
    rs = rows(tmp_path / "depth-ablation" / "results.jsonl")
    assert {r["task"] for r in rs} == {"single", "fidelity"} and len({r["method"] for r in rs}) == 13


def test_chat(capsys):
    out = run(capsys, f"chat --model tiny-gemma3 --script {TURNS} --forget-swa-before 3 --max-new-tokens 4")
    kinds = [line.split()[2] for line in out.splitlines() if line.startswith("[turn")]
    assert kinds == ["miss", "hit", "replay", "hit"]


def test_serve(tmp_path):
    """README's example on tiny-gemma3 (a real server process): its curl request, then its openai client,
    one conversation growing from 1,000 to 4,096 tokens (not / a multiple of the 256-token block)."""
    import httpx
    import openai

    from kvstrata_lab.serve_bench.process import ServerProcess

    prompt = ("There and back again. " * 200)[:4096]  # one token per byte
    with ServerProcess(
        "tiny-gemma3", "--method", "nvfp4;sliding=fp8", name="tiny-gemma3", log_path=tmp_path / "serve.log"
    ) as server:
        first = httpx.post(
            server.base_url + "/completions", timeout=300,
            json={"model": "tiny-gemma3", "prompt": prompt[:1000], "max_tokens": 8, "temperature": 0},
        ).json()
        assert first["kvstrata"]["kind"] == "miss" and first["usage"]["prompt_tokens"] == 1000
        oa = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        for cached in (
            768, 3840,
        ):  # the 1,000-token turn's 3 whole blocks, then all 15 of the 4,096-token turn
            r = oa.completions.create(model="tiny-gemma3", prompt=prompt, max_tokens=8, temperature=0)
            assert r.kvstrata["kind"] == "hit" and r.usage.prompt_tokens_details.cached_tokens == cached
            assert r.usage.prompt_tokens == 4096 and r.usage.completion_tokens >= 1


def test_serve_bench(capsys, tmp_path):
    """The documented functional run on tiny-gemma3 (no chat template: completions): a 4k probe with
    its replay, 1,000-token conversations with the store on and off, answers re-checked."""
    run(
        capsys,
        "serve-bench --model tiny-gemma3 --clients 2 --turns 3 --context 1000 --tool-tokens 64 "
        f"--max-tokens 4 --probe-tokens 4096 --probe-swa-ttl 5 --check 2 --duration 120 --out {tmp_path}",
    )
    s = json.loads((tmp_path / "serve_bench.json").read_text())["summary"]
    assert s["endpoint"] == "completions" and s["probe"]["prompt_tokens"] == 4096
    assert s["probe"]["kinds"] == ["miss"] + ["hit"] * 5 + ["replay"] and s["probe"]["errors"] == 0
    on, off = s["phases"]["store"], s["phases"]["no_store"]
    assert on["requests"] == off["requests"] == 6 and on["errors"] == off["errors"] == 0
    assert on["hit_rate_later_turns"] == 1.0
    assert s["check"] == {"checked": 2, "differ": 0}
    assert "| store |" in (tmp_path / "serve_bench.md").read_text()


def test_serve_batch_bench(capsys, tmp_path):
    """The documented functional run on tiny-gemma3 (bf16 weights): real batched, unbatched and KV-budget
    servers; every request answered and the server never ran more sequences than its budget holds."""
    from kvstrata.models import load_config
    from kvstrata.serve.scheduler import kv_rate

    run(
        capsys,
        "serve-batch-bench --model tiny-gemma3 --methods bf16,nvfp4 --streams 1,3 --requests 1 "
        "--level-requests 2 --prompt-tokens 40 --max-tokens 6 --probe-tokens 200 --budget-sequences 2 "
        f"--budget-streams 4 --dtype bf16 --out {tmp_path}",
    )
    result = json.loads((tmp_path / "tiny-gemma3-bf16.json").read_text())
    assert result["config"]["dtype"] == "bf16"
    for method, rows in result["methods"].items():
        for mode in ("batched", "unbatched"):
            levels = rows[mode]["levels"]
            assert [x["streams"] for x in levels] == [1, 3] and not any(x["errors"] for x in levels)
            assert all(x["tokens"] > 0 and x["tokens_per_s"] > 0 for x in levels)
            assert rows[mode]["probe"]["loaded_ttft_s"] is not None
        need = kv_rate(load_config("tiny-gemma3"), method).bytes(40 + 6)
        assert 1 <= rows["budget"]["running_max"] <= result["budget_bytes"] // need
        assert rows["budget"]["errors"] == 0
    text = (tmp_path / "tiny-gemma3-bf16.md").read_text()
    assert "| `nvfp4` | batched | 3 |" in text and "(bf16 weights)" in text


@pytest.mark.parametrize("tokens", [1000, 4096])
def test_topk_overlap(capsys, tmp_path, tokens):
    out = run(
        capsys, f"topk-overlap --model tiny-llama,tiny-gemma3 --tokens {tokens} --k 256 --out {tmp_path}"
    )
    assert "tiny-llama: mean top-256 overlap" in out
    assert json.loads((tmp_path / "topk_overlap.json").read_text())["tiny-llama"]["tokens"] == tokens


def test_sparse_recall(capsys, tmp_path):
    out = run(capsys, f"sparse-recall --model tiny-gemma3 --lengths 300,520 --prompts 1 "
                      f"--method topk:k=64,window=16 --out {tmp_path}")
    assert "| 300 | 2 (F) |" in out and "| 520 | 2 (F) |" in out
    result = json.loads((tmp_path / "sparse_recall.json").read_text())
    assert set(result["seconds"]) == {"300", "520"} and result["prompts"][0]["needle_spans"][0]
    assert (tmp_path / "sparse_recall.png").exists() and (tmp_path / "sparse_recall_positions.png").exists()


@pytest.mark.parametrize("preset, factor", [("small-v41", 16), ("tiny-v41", 3)])
def test_v41_prefill(capsys, tmp_path, preset, factor):
    out = run(
        capsys, f"v41-prefill --preset {preset} --factor {factor} --repeats 1 --out {tmp_path / 'p.json'}"
    )
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["prompt_tokens"] == factor * r["n_win"] and f"{r['prompt_tokens']} prompt tokens" in out


@pytest.mark.parametrize("extra", ["", """--override '{"swa_values": true}'"""])
def test_train_ref(capsys, tmp_path, extra):
    out = run(
        capsys, f"train-ref --preset tiny-v41 --steps 2 --batch 4 --eval-sequences 8 {extra} --out {tmp_path}"
    )
    assert "v41: recall" in out and "dense: recall" in out
    assert json.loads((tmp_path / "train_ref.json").read_text())["config"]["steps"] == 2


@pytest.mark.integration
@pytest.mark.parametrize("model, tokens", [("smollm2-135m", 1000), ("gemma3-270m", 3000)])
def test_passkey_real(capsys, model, tokens):
    out = run(capsys, f"passkey --model {model} --tokens {tokens} --methods nvfp4")
    assert out.startswith(f"{model}: {tokens} tokens")


@pytest.mark.integration
@pytest.mark.parametrize("tokens", [4096, 3000])
def test_store_bench_real(capsys, tmp_path, tokens):
    """Gemma-3-270M at 4k and 3k (not a multiple of the 256-token block): both stopped with an empty
    continuation before the text sources were exact (about a minute each)."""
    result = json.loads(run(capsys, f"store-bench --model gemma3-270m --tokens {tokens} --out {tmp_path}"))
    assert result["tokens"] == tokens and result["warm_vs_exact"]["top1"] == 1.0
    cached = (tokens - 1) // 256 * 256  # whole blocks stored, one token kept back for the first logits
    # a replay runs the last w windows (512 each) of the cached prefix, then the rest of the prompt
    assert [r["computed_tokens"] for r in result["replay"]] == [tokens - cached + 512 * w for w in (1, 2, 4)]


@pytest.mark.parametrize("lengths", ["1000,4096", "2048"])
def test_kernels_bench(capsys, tmp_path, lengths):
    """`kvstrata kernels-bench` (README: default lengths 2k..64k; here short ones) writes rows and a plot."""
    out = tmp_path / "kernels"
    run(capsys, f"kernels-bench --lengths {lengths} --repeats 1 --out {out}")
    rs = rows(out / "kernels.jsonl")
    assert {r["tokens"] for r in rs} == {int(x) for x in lengths.split(",")}
    codecs = {r["codec"] for r in rs}
    assert {"sdpa-bf16", "sdpa-f32", "bf16", "fp8", "nvfp4", "mxfp4", "int4", "int2"} <= codecs
    assert all(r["seconds"] > 0 for r in rs) and (out / "kernels.png").stat().st_size > 1000


def test_memory_bench(capsys, tmp_path):
    """`kvstrata memory-bench` on the tiny Llama at a length that is no multiple of the chunk."""
    out = tmp_path / "mem"
    run(
        capsys,
        f"memory-bench --model tiny-llama --tokens 1000 --methods bf16,nvfp4 --chunks 256,0 --out {out}",
    )
    rs = rows(out / "memory.jsonl")
    assert [(r["method"], r["prefill_chunk"]) for r in rs] == [
        ("bf16", 256), ("bf16", 0), ("nvfp4", 256), ("nvfp4", 0),
    ]
    assert all(r["context_tokens"] >= 1000 and r["kv_mb"] > 0 and r["peak_rss_mb"] > 0 for r in rs)


def test_scaling_bench(capsys, tmp_path):
    """`kvstrata scaling-bench` on the tiny Gemma-3 past its 16-token sliding window: a row per point,
    each in its own process; transformers' two caches, filled from the saved prefill, decode alike."""
    out = tmp_path / "scaling"
    run(capsys, f"scaling-bench --model tiny-gemma3 --lengths 300,700 --methods dynamic,static,nvfp4 "
                f"--new-tokens 4 --out {out} --work {tmp_path / 'prefills'}")
    rs = rows(out / "scaling.jsonl")
    assert [(r["tokens"], r["method"]) for r in rs] == [
        (n, m) for n in (300, 700) for m in ("dynamic", "static", "nvfp4")]
    assert all(r["decode_s_per_token"] > 0 and r["kv_mb"] > 0 and r["peak_rss_mb"] >= r["baseline_rss_mb"]
               for r in rs)
    by = {(r["tokens"], r["method"]): r for r in rs}
    assert all(by[(n, "dynamic")]["greedy"] == by[(n, "static")]["greedy"] for n in (300, 700))
    assert by[(700, "nvfp4")]["kv_mb"] < by[(700, "dynamic")]["kv_mb"]
    assert (out / "scaling.png").stat().st_size > 1000
    run(capsys, f"scaling-bench --model tiny-gemma3 --lengths 300 --methods nvfp4 --new-tokens 4 --out {out} "
                f"--work {tmp_path / 'prefills'}")
    assert len(rows(out / "scaling.jsonl")) == 6  # a point already there is not run again


@pytest.mark.parametrize("model, tokens, budget", [("tiny-llama", 448, "--top1 0.9"),
                                                   ("tiny-gemma3", 1000, "--top1 0 --max-drop 1")])
def test_tune(capsys, tmp_path, model, tokens, budget):
    ladder = "bf16,fp8,int2:r=8,group=8"
    out = run(capsys, f"tune --model {model} --length {tokens} --ladder {ladder} --calib 100 --heldout 0 "
                      f"{budget} --out {tmp_path}")
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert out.startswith(f"spec: {cert['spec']}\n") and "held-out (1 per task" in out
    held = cert["heldout"]
    assert cert["length"] == tokens and held["bytes_per_token"] < held["bf16_bytes_per_token"]


def test_serve_soak(capsys, tmp_path):
    """The soak needs minutes of load and a Redis Cluster (its reference run is committed under
    docs/results/soak); here: bad input is refused before any Redis node or server starts."""
    for argv in (["--duration", "5"], ["--clients", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["serve-soak", "--model", "tiny-gemma3", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and argv[0] in err and "Traceback" not in err
    (tmp_path / "a-file").write_text("")
    assert main(["serve-soak", "--model", "tiny-gemma3", "--out", str(tmp_path / "a-file" / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and len(err.strip().splitlines()) == 1


@pytest.mark.integration
def test_vllm_bench(capsys, tmp_path):
    """`kvstrata vllm-bench` with real vLLM engines (vLLM's environment) on SmolLM2, small sizes: vLLM
    alone and the kvstrata connector with NVFP4 records, two lifetimes each."""
    out = tmp_path / "vllm"
    run(capsys, f"vllm-bench --configs vllm,kvstrata-nvfp4 --clients 1 --turns 2 --context 200 "
                f"--tool-tokens 30 --answer-tokens 4 --probe-tokens 600 --n 2 --length 400 --chunk-tokens 64 "
                f"--out {out} --work {tmp_path / 'work'}")
    result = json.loads((out / "vllm-bench.json").read_text())
    alone, ours = result["rows"]["vllm"], result["rows"]["kvstrata-nvfp4"]
    assert alone["restart_cached"] == 0 and alone["bytes_per_token"] is None
    assert ours["restart_cached"] == 600 // 64 * 64  # every whole chunk of the probe, from the store
    assert 0.2 < ours["bytes_per_token"] / (30 * 3 * 64 * 2 * 2) < 0.35  # NVFP4 ~ 4.5 of bf16's 16 bits
    assert ours["later_turn_ttft_s"]["n"] == 1 and ours["restored_tokens"] > 0
    assert ours["pooled_layers"] == [] and ours["pool_bytes_per_token"] == 0  # no sliding layers: none pooled
    assert "kvstrata, nvfp4" in (out / "README.md").read_text()
    assert (tmp_path / "work" / "vllm-bench-vllm" / ".kvstrata-vllm-bench").exists()


@pytest.fixture(scope="module")
def ced_dir(tmp_path_factory):
    """tiny Llama as an encoder-decoder: `kvstrata retrofit`'s documented flags at a tiny size."""
    out = tmp_path_factory.mktemp("ced") / "tiny"
    assert main(shlex.split(f"retrofit --model tiny-llama --out {out} --texts 2 --heldout 1 --length 2048 "
                            "--n-win 64 --distill-minutes 0.02")) == 0
    return out


def test_retrofit(capsys, tmp_path, ced_dir):
    report = json.loads((ced_dir / "ced.json").read_text())
    assert (report["split"], report["n_win"]) == (2, 64) and len(report["key_error"]) == 2
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(("There and back again. " * 40)[:700])
    err = run(capsys, f"generate --model {ced_dir} --prompt-file {prompt} --max-new-tokens 4 --method nvfp4",
              "err")
    assert "[nvfp4] context 70" in err  # 700 bytes (a token each): two chunks wait for the decoder


def test_chat_on_an_encoder_decoder(capsys, tmp_path):
    """The store keeps an encoder-decoder's H(split) (`--store-as hidden`): a chat's later turns hit."""
    out_dir = tmp_path / "ced"
    assert main(shlex.split(f"retrofit --model tiny-llama --out {out_dir} --texts 2 --heldout 1 --length 512 "
                            "--n-win 32 --distill-minutes 0 --store-as hidden")) == 0
    assert json.loads((out_dir / "config.json").read_text())["kvstrata_ced"]["store"] == "hidden"
    out = run(capsys, f"chat --model {out_dir} --script {TURNS} --max-new-tokens 4 --method nvfp4")
    kinds = [line.split()[2] for line in out.splitlines() if line.startswith("[turn")]
    assert kinds[0] == "miss" and set(kinds[1:]) == {"hit"}


@pytest.mark.parametrize("command", ["serve-bench", "serve-soak"])
def test_batched_serving_refuses_an_encoder_decoder_in_one_line(capsys, tmp_path, ced_dir, command):
    """`kvstrata serve` has no batched encoder-decoder step: the commands that run it refuse one first."""
    assert main([command, "--model", str(ced_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is an encoder-decoder" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, words", [
    ("--split 4", "split must be a layer in [1, 3]"), ("--n-win 0", "--n-win: must be in"),
    ("--store-as both", "--store-as: invalid choice"),
    ("--distill-minutes -1", "--distill-minutes: must be in"),
])
def test_retrofit_refuses_a_bad_plan_in_one_line(capsys, tmp_path, argv, words):
    try:
        code = main(shlex.split(f"retrofit --model tiny-llama --out {tmp_path / 'x'} {argv}"))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_retrofit_eval(capsys, tmp_path, ced_dir):
    argv = f"--model tiny-llama --ced {ced_dir} --out {tmp_path} --n 2 --length 1024 --timing 300"
    out = run(capsys, f"retrofit-eval {argv}")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["answers"]["n"] == 2 and len(result["attention_error"]) == 2
    assert result["prefill"][0]["tokens"] == 300 and '"ratio"' in out
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 2
    store = {row["store"]: row for row in result["store"]}  # the store's evidence, both ways, at nvfp4
    assert set(store) == {"projected", "hidden"}
    assert all(p["hit_equals_cold"] for r in store.values() for p in r["prompts"])
    assert [p["kind"] for p in store["projected"]["prompts"]] == ["replay", "hit"]  # n_win 64: 16 / 200 more
    assert store["hidden"]["decoder_bytes_per_token"] < store["projected"]["decoder_bytes_per_token"]
    # a rerun without --timing (more answers, say) keeps the prefill rows the first run measured, one
    # timing other lengths adds its rows beside them
    rerun = argv.replace("--n 2", "--n 3").replace("--timing 300", "--timing ''")
    run(capsys, f"retrofit-eval {rerun} --store-method ''")
    again = json.loads((tmp_path / "result.json").read_text())
    assert again["prefill"] == result["prefill"] and again["answers"]["n"] == 3
    run(capsys, f"retrofit-eval {rerun.replace(chr(39) * 2, '200')} --repeats 1 --store-method ''")
    more = json.loads((tmp_path / "result.json").read_text())["prefill"]
    assert [r["tokens"] for r in more] == [200, 300] and more[1] == result["prefill"][0]


def test_step_bench(capsys, tmp_path):
    """`kvstrata step-bench` at a tiny size: the table and profile written; a bad spec is one line."""
    out = run(capsys, f"step-bench --model tiny-llama --methods nvfp4 --rows 2 --prompt-tokens 8 --rounds 1 "
                      f"--steps 1 --torch-linear --out {tmp_path}")
    text = (tmp_path / "tiny-llama.md").read_text()
    assert "results:" in out and "| `nvfp4` |" in text and "| `nvfp4 (torch linear)` |" in text
    assert main(shlex.split(f"step-bench --model tiny-llama --methods nvfp5 --out {tmp_path}")) == 2
    assert "nvfp5" in capsys.readouterr().err
