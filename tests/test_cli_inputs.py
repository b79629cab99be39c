"""Bad CLI input, command by command: exit code 2, one line `kvstrata: error: ...` naming the flag or
field and the problem, no traceback, nothing done. Run in-process (`main`), a few through a real
subprocess; cases that need a model use the tiny local ones."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.models.tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def p(tmp_path_factory):
    """Paths the cases refer to by name."""
    d = tmp_path_factory.mktemp("inputs")
    files = {"dir": d / "adir", "fifo": d / "fifo", "binary": d / "bad.bin", "blank": d / "blank.txt",
             "llama": save_tiny(d / "tiny-llama", "llama"), "notastore": d / "notastore", "out": d / "out"}
    files["dir"].mkdir()
    os.mkfifo(files["fifo"])
    files["binary"].write_bytes(b"\xff\xfe\x00abc")
    files["blank"].write_text("  \n\t\n")
    files["noturns"] = d / "noturns.txt"  # a regular file: no turns in it, and no directory under it
    files["noturns"].write_text("\n---\n  \n---\n")
    files["script"] = d / "script.txt"
    files["script"].write_text("hello\n---\nand again\n")
    files["shortkey"] = d / "keys.txt"
    files["shortkey"].write_text("# one key, too short\nabc\n")
    files["notastore"].mkdir()
    (files["notastore"] / "notes.txt").write_text("mine")
    for name, body in {
        "bs": "block_size = 'abc'", "rc": "redis_cluster = 'false'", "cap": "global_capacity_gb = -1",
        "ttl": "swa_ttl_seconds = '5m'", "nan": "retention_hours = nan", "unknown": "blok_size = 3",
        "url": "redis_url = 'http://x'", "secret": "secret = 'xyz'", "toml": "block_size = = 3",
        "share": "swa_ram_share = 2", "root": f"root = '{files['notastore']}'",
    }.items():
        files[name] = d / f"{name}.toml"
        root = f"root = '{d / 'store'}'\n" if name != "root" else ""
        files[name].write_text(f"[store]\n{root}{body}\n")
    files["badrows"] = d / "rows"
    files["badrows"].mkdir()
    bad = '{"model": "m", "length": 2048, "task": "single", "ind\n[1, 2]\n'
    (files["badrows"] / "results.jsonl").write_text(bad)
    return {k: str(v) for k, v in files.items()}


GEN = ["generate", "--model", "{llama}"]
PAST = "exceeds the model's context"
SERVE = ["serve", "--model", "{llama}"]
PASSKEY = ["passkey", "--model", "{llama}"]
SERVE_BENCH = ["serve-bench", "--model", "{llama}"]
CASES = [
    ("topk F0", [*GEN, "--prompt", "hi", "--method", "topk:schedule=F0"], "schedule count"),
    ("topk huge schedule", [*GEN, "--prompt", "hi", "--method", "topk:schedule=F1U2000000000"],
     "schedule count"),
    ("topk k=0", [*GEN, "--prompt", "hi", "--method", "topk:k=0"], "topk: need 1 <= k"),
    ("topk rank", [*GEN, "--prompt", "hi", "--method", "topk:rank=1600000000"], "rank must be"),
    ("int4 group", [*GEN, "--prompt", "hi", "--method", "int4:group=1000000000"], "group must be"),
    ("fp8 block", [*GEN, "--prompt", "hi", "--method", "fp8:block=1000000000"], "fp8: block must be"),
    ("r huge", [*GEN, "--prompt", "hi", "--method", "nvfp4:r=100000000000"], "r must be"),
    ("r not int", [*GEN, "--prompt", "hi", "--method", "nvfp4:r=1.5"], "parameter r must be an integer in"),
    ("depth tol nan", [*GEN, "--prompt", "hi", "--method", "depth:tol=nan"], "tol='nan'"),
    ("depth g", [*GEN, "--prompt", "hi", "--method", "depth:g=100000000"], "depth: need 2 <= g"),
    ("snapkv pool", [*GEN, "--prompt", "hi", "--method", "snapkv:pool=1001"], "pool"),
    ("streaming sinks", [*GEN, "--prompt", "hi", "--method", "streaming:sinks=-1"], "sinks"),
    ("class twice", [*GEN, "--prompt", "hi", "--method", "nvfp4;sliding=fp8;sliding=int4"],
     "'sliding' given twice"),
    ("unknown method", [*GEN, "--prompt", "hi", "--method", "fp5"], "unknown method 'fp5'"),
    ("empty method", [*GEN, "--prompt", "hi", "--method", " "], "argument --method: must not be empty"),
    ("prompt-file dir", [*GEN, "--prompt-file", "{dir}"], "--prompt-file: {dir} is a directory"),
    ("prompt-file /dev/zero", [*GEN, "--prompt-file", "/dev/zero"],
     "--prompt-file: /dev/zero is not a regular file"),
    ("prompt-file fifo", [*GEN, "--prompt-file", "{fifo}"], "is not a regular file"),
    ("prompt-file binary", [*GEN, "--prompt-file", "{binary}"], "not valid UTF-8"),
    ("prompt-file missing", [*GEN, "--prompt-file", "{dir}/nope.txt"], "does not exist"),
    ("prompt-file blank", [*GEN, "--prompt-file", "{blank}"], "--prompt-file: the prompt is empty"),
    ("empty prompt", [*GEN, "--prompt", ""], "argument --prompt: must not be empty"),
    ("huge max-new-tokens", [*GEN, "--prompt", "hi", "--max-new-tokens", "9" * 21], "--max-new-tokens"),
    ("negative max-new-tokens", [*GEN, "--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens"),
    ("max-new-tokens past context", [*GEN, "--prompt", "hi", "--max-new-tokens", "16383"], PAST),
    ("prompt past context", [*GEN, "--prompt", "hi " * 20000, "--max-new-tokens", "2"], PAST),
    ("passkey tokens -5", [*PASSKEY, "--tokens", "-5"], "argument --tokens"),
    ("passkey depth 2.0", [*PASSKEY, "--depth", "2.0"], "argument --depth"),
    ("passkey depth nan", [*PASSKEY, "--depth", "nan"], "argument --depth"),
    ("passkey past context", [*PASSKEY, "--tokens", "100000000"], "--tokens: 100,000,000"),
    ("passkey bad method", [*PASSKEY, "--methods", "bf16|fp5"], "unknown method 'fp5'"),
    ("override unknown", ["train-ref", "--override", '{"nosuch": 1}', "--out", "{out}"],
     "unknown V41Config fields nosuch"),
    ("override not object", ["train-ref", "--override", "[1]", "--out", "{out}"], "JSON object"),
    ("override not JSON", ["train-ref", "--override", "{bad", "--out", "{out}"], "not valid JSON"),
    ("train steps", ["train-ref", "--steps", "-1", "--out", "{out}"], "argument --steps"),
    ("train pairs > vocab", ["train-ref", "--pairs", "100", "--seq-len", "512", "--out", "{out}"],
     "pairs (100)"),
    ("train seq-len", ["train-ref", "--seq-len", "8", "--pairs", "4", "--out", "{out}"], "seq_len (8)"),
    ("train preset", ["train-ref", "--preset", "nosuch", "--out", "{out}"], "unknown V4.1 preset"),
    ("store config dir", ["store", "stats", "--config", "{dir}"], "--config: {dir} is a directory"),
    ("store config /dev/zero", ["store", "stats", "--config", "/dev/zero"], "not a regular file"),
    ("store config missing", ["store", "stats", "--config", "{dir}/none.toml"], "does not exist"),
    ("block_size abc", ["store", "stats", "--config", "{bs}"], "block_size: expected an integer, got 'abc'"),
    ("redis_cluster 'false'", ["store", "verify", "--config", "{rc}"],
     "redis_cluster: expected true or false"),
    ("capacity -1", ["store", "stats", "--config", "{cap}"], "global_capacity_gb: must be > 0"),
    ("ttl as text", ["store", "stats", "--config", "{ttl}"], "swa_ttl_seconds: expected a finite number"),
    ("retention nan", ["store", "gc", "--config", "{nan}"], "retention_hours: expected a finite number"),
    ("unknown setting", ["store", "stats", "--config", "{unknown}"], "unknown store settings: blok_size"),
    ("redis_url scheme", ["store", "stats", "--config", "{url}"], "redis_url: expected a redis://"),
    ("secret not hex", ["store", "stats", "--config", "{secret}"], "secret: the store secret must be hex"),
    ("share > 1", ["store", "stats", "--config", "{share}"], "swa_ram_share: must be > 0"),
    ("bad TOML", ["store", "stats", "--config", "{toml}"], "not valid TOML"),
    ("root not a store", ["store", "verify", "--config", "{root}"], "has no .kvstrata-store marker"),
    ("accounting tokens", ["accounting", "--model", "{llama}", "--tokens", "-5"], "argument --tokens"),
    ("bench n", ["bench", "--n", "-1", "--out", "{out}"], "argument --n"),
    ("bench task", ["bench", "--tasks", "nosuch", "--model", "{llama}", "--out", "{out}"],
     "unknown task 'nosuch'"),
    ("bench length", ["bench", "--model", "{llama}@100000000", "--out", "{out}"], "exceed"),
    ("topk-overlap k", ["topk-overlap", "--model", "{llama}", "--k", "0", "--out", "{out}"], "argument --k"),
    ("topk-overlap k > tokens",
     ["topk-overlap", "--model", "{llama}", "--k", "99", "--tokens", "64", "--out", "{out}"],
     "--k: 99 is more than --tokens 64"),
    ("sparse-recall method", ["sparse-recall", "--model", "{llama}", "--method", "nvfp4", "--out", "{out}"],
     "top-k read over the bf16 store"),
    ("sparse-recall lengths", ["sparse-recall", "--model", "{llama}", "--lengths", "20", "--out", "{out}"],
     "no room for a needle prompt"),
    ("depth-similarity group", ["depth-similarity", "--model", "{llama}", "--group", "0"],
     "argument --group"),
    ("depth-similarity tokens",
     ["depth-similarity", "--model", "{llama}", "--tokens", "100000", "--out", "{out}"],
     "--tokens: 100,000 tokens exceed"),
    ("v41-prefill factor", ["v41-prefill", "--factor", "0"], "argument --factor"),
    ("v41-prefill preset", ["v41-prefill", "--preset", "nosuch"], "unknown V4.1 preset"),
    ("chat bad config", ["chat", "--model", "{llama}", "--script", "{dir}", "--config", "{bs}"],
     "block_size"),
    ("chat script is a dir", ["chat", "--model", "{llama}", "--script", "{dir}"],
     "--script: {dir} is a directory"),
    ("chat max-new-tokens", ["chat", "--max-new-tokens", "0"], "argument --max-new-tokens"),
    ("chat tenant", ["chat", "--tenant", ""], "argument --tenant: must not be empty"),
    ("chat swa turn", ["chat", "--forget-swa-before", "0"], "argument --forget-swa-before"),
    ("store-bench tokens", ["store-bench", "--tokens", "-1"], "argument --tokens"),
    ("store-bench no sliding layers",
     ["store-bench", "--model", "{llama}", "--tokens", "512", "--out", "{out}"],
     "needs a model with sliding-window layers"),
    ("replay-check prompts", ["replay-check", "--prompts", "0"], "argument --prompts"),
    ("replay-check windows", ["replay-check", "--model", "{llama}", "--tokens", "600", "--windows", "1,x"],
     "--windows: expected whole numbers of sliding windows >= 1, got '1,x'"),
    ("replay-check under a block",
     ["replay-check", "--model", "{llama}", "--tokens", "300", "--out", "{out}"],
     "the turn before the split must be longer than one 256-token block"),
    ("replay-check depth", ["replay-check", "--model", "{llama}", "--method", "depth:g=2+nvfp4"],
     "the persistent store does not hold them"),
    ("chat replay-tokens", ["chat", "--replay-tokens", "most"], "argument --replay-tokens: expected a whole"),
    ("serve model missing", ["serve", "--model", "{dir}/nope"], "neither a known model"),
    ("serve empty model", ["serve", "--model", " "], "argument --model: must not be empty"),
    ("serve bad method", [*SERVE, "--method", "fp5"], "unknown method 'fp5'"),
    ("serve port 0", [*SERVE, "--port", "0"], "argument --port: must be in [1, 65,535], got 0"),
    ("serve port huge", [*SERVE, "--port", "70000"], "argument --port"),
    ("serve max-active 0", [*SERVE, "--max-active", "0"], "argument --max-running/--max-active"),
    ("serve max-running huge", [*SERVE, "--max-running", "5000"], "argument --max-running/--max-active"),
    ("serve batched tokens 0", [*SERVE, "--max-batched-tokens", "0"], "argument --max-batched-tokens"),
    ("serve chunk over budget", [*SERVE, "--max-batched-tokens", "64", "--prefill-chunk", "128"],
     "max_batched_tokens (64) must be >= prefill_chunk (128)"),
    ("serve kv budget -1", [*SERVE, "--kv-budget-mb", "-1"], "argument --kv-budget-mb"),
    ("batch bench streams 0", ["serve-batch-bench", "--streams", "1,0"], "argument --streams: expected"),
    ("batch bench prompt past context", ["serve-batch-bench", "--model", "tiny-llama", "--prompt-tokens",
                                         "100000"], "--prompt-tokens: 100,128 tokens exceed"),
    ("serve max-queue -1", [*SERVE, "--max-queue", "-1"], "argument --max-queue"),
    ("serve timeout nan", [*SERVE, "--request-timeout", "nan"], "argument --request-timeout"),
    ("serve timeout 0", [*SERVE, "--request-timeout", "0"], "argument --request-timeout"),
    ("serve default-max-tokens", [*SERVE, "--default-max-tokens", "0"], "argument --default-max-tokens"),
    ("serve replay-tokens", [*SERVE, "--replay-tokens", "-1"], "argument --replay-tokens"),
    ("serve memory -1", [*SERVE, "--memory-global-gb", "-1"], "argument --memory-global-gb"),
    ("serve retention", [*SERVE, "--default-retention", "1h"], "argument --default-retention"),
    ("serve key file dir", [*SERVE, "--api-key-file", "{dir}"], "--api-key-file: {dir} is a directory"),
    ("serve key file /dev/zero", [*SERVE, "--api-key-file", "/dev/zero"], "not a regular file"),
    ("serve key file fifo", [*SERVE, "--api-key-file", "{fifo}"], "not a regular file"),
    ("serve key file missing", [*SERVE, "--api-key-file", "{dir}/nope"], "does not exist"),
    ("serve key file binary", [*SERVE, "--api-key-file", "{binary}"], "not valid UTF-8"),
    ("serve key file blank", [*SERVE, "--api-key-file", "{blank}"], "{blank} holds no keys"),
    ("serve key too short", [*SERVE, "--api-key-file", "{shortkey}"], "at least 8 characters"),
    ("serve config dir", [*SERVE, "--config", "{dir}"], "--config: {dir} is a directory"),
    ("serve config setting", [*SERVE, "--config", "{bs}"], "block_size: expected an integer"),
    ("serve root not a store", [*SERVE, "--config", "{root}"], "has no .kvstrata-store marker"),
    ("serve-bench clients 0", ["serve-bench", "--clients", "0", "--out", "{out}"], "argument --clients"),
    ("serve-bench duration", ["serve-bench", "--duration", "inf", "--out", "{out}"], "argument --duration"),
    ("serve-bench seed", ["serve-bench", "--seed", "-1", "--out", "{out}"], "argument --seed"),
    ("serve-bench block", ["serve-bench", "--block-size", "0", "--out", "{out}"], "argument --block-size"),
    ("serve-bench model", ["serve-bench", "--model", "{dir}/nope", "--out", "{out}"],
     "neither a known model"),
    ("serve-bench method", [*SERVE_BENCH, "--method", "fp5", "--out", "{out}"], "unknown method 'fp5'"),
    ("serve-bench peer", [*SERVE_BENCH, "--peer", "sglang", "--out", "{out}"],
     "argument --peer: invalid choice"),
    ("bench llama.cpp type",
     ["bench", "--model", "{llama}@128", "--peers", "llamacpp:q3_k", "--out", "{out}"],
     "unknown llama.cpp KV cache type 'q3_k'"),
    ("serve-bench past context",
     [*SERVE_BENCH, "--context", "20000", "--probe-tokens", "0", "--out", "{out}"],
     "past the model's context of 16,384"),
    ("serve-bench probe past context",
     [*SERVE_BENCH, "--probe-tokens", "16384", "--out", "{out}"],
     "--probe-tokens 16,384"),
    # found only after the weights loaded, until they were checked from the tokenizer and config.json
    ("method layer past the model", [*GEN, "--prompt", "hi", "--method", "nvfp4;layers[7]=fp8"],
     "assigns layer 7; the model has 4 layers"),
    ("outliers past head_dim", [*GEN, "--prompt", "hi", "--method", "nvfp4:outliers=32"],
     "keeps 32 outlier channels; the model's head_dim is 32"),
    ("topk rank past head_dim", [*GEN, "--prompt", "hi", "--method", "topk:indexer=lowrank,rank=64"],
     "topk: rank must be in 1..32 (the head dim), got 64"),
    ("chat keep policy in the store",
     ["chat", "--model", "{llama}", "--method", "snapkv", "--script", "{script}"],
     "keep policies do not apply"),
    ("chat layer past the model",
     ["chat", "--model", "{llama}", "--method", "bf16;layers[40]=fp8", "--script", "{script}"],
     "assigns layer 40"),
    ("chat script without turns", ["chat", "--model", "{llama}", "--script", "{noturns}"],
     "--script: {noturns} holds no turns"),
    ("chat max-new-tokens past context",
     ["chat", "--model", "{llama}", "--method", "nvfp4", "--script", "{script}", "--max-new-tokens", "20000"],
     "the first turn is 22 tokens; with 20,000 new tokens"),
    ("serve keep policy in the store", [*SERVE, "--method", "snapkv"], "keep policies do not apply"),
    ("serve layer past the model", [*SERVE, "--method", "fp8;layers[4]=nvfp4"], "assigns layer 4"),
    ("serve host unresolvable", [*SERVE, "--host", "999.1.1.1"], "--host '999.1.1.1' does not resolve"),
    ("serve host not local", [*SERVE, "--host", "192.0.2.1"], "--host 192.0.2.1 --port 8000: cannot listen"),
    ("passkey layer past the model", [*PASSKEY, "--methods", "bf16|nvfp4;layers[9]=fp8"], "assigns layer 9"),
    ("passkey tokens under the fixed text", [*PASSKEY, "--tokens", "200"], "cannot hold even the fixed text"),
    ("tune out unwritable", ["tune", "--model", "{llama}", "--length", "128", "--out", "{noturns}/tune"],
     "--out: cannot write to {noturns}/tune: {noturns} is not a directory"),
    ("tune rung past head_dim",
     ["tune", "--model", "{llama}", "--length", "128", "--ladder", "bf16,nvfp4:outliers=40",
      "--out", "{out}"],
     "keeps 40 outlier channels"),
    ("bench method past head_dim", ["bench", "--model", "{llama}@128", "--methods", "nvfp4:outliers=40",
                                    "--out", "{out}"], "keeps 40 outlier channels"),
    ("bench out unwritable", ["bench", "--model", "{llama}@128", "--out", "{noturns}/bench"],
     "--out: cannot write to {noturns}/bench"),
    ("serve-bench keep policy in the store", [*SERVE_BENCH, "--method", "snapkv", "--out", "{out}"],
     "keep policies do not apply"),
    ("serve-bench out unwritable", [*SERVE_BENCH, "--out", "{noturns}/sb"], "--out: cannot write to"),
    ("memory-bench layer past the model",
     ["memory-bench", "--model", "{llama}", "--methods", "bf16,fp8;layers[4]=int4", "--out", "{out}"],
     "assigns layer 4"),
    ("scaling-bench length past the context",
     ["scaling-bench", "--model", "{llama}", "--lengths", "2048,99999999", "--out", "{out}"], "--lengths"),
    ("scaling-bench unknown method",
     ["scaling-bench", "--model", "{llama}", "--lengths", "300", "--methods", "static,nvfp5",
      "--out", "{out}"], "nvfp5"),
    ("vllm-bench unknown row", ["vllm-bench", "--configs", "vllm,lmcache", "--out", "{out}"],
     "argument --configs: expected comma-separated rows among vllm, example"),
    ("vllm-bench chunk off vLLM's blocks", ["vllm-bench", "--model", "{llama}", "--chunk-tokens", "48",
                                            "--probe-tokens", "100", "--length", "100", "--out", "{out}"],
     "chunk_tokens must be a multiple of vLLM's block size 32"),
    ("vllm-bench spec the store cannot hold",
     ["vllm-bench", "--model", "{llama}", "--spec", "snapkv:keep=0.5", "--probe-tokens", "100",
      "--length", "100", "--out", "{out}"],
     "keep policies do not apply"),
    ("vllm-bench probe past the context", ["vllm-bench", "--model", "{llama}", "--probe-tokens", "99999999",
                                           "--out", "{out}"], "--probe-tokens"),
    ("vllm-bench allocator neither on nor off",
     ["vllm-bench", "--hybrid-allocator", "maybe", "--out", "{out}"],
     "argument --hybrid-allocator: invalid choice: 'maybe'"),
    ("report bad rows", ["report", "{badrows}"], "results.jsonl: 2 bad row(s)"),
    ("report missing dir", ["report", "{dir}/none"], "holds no benchmark results"),
]


def fill(args, p):
    out = []
    for a in args:
        for name, path in p.items():
            a = a.replace("{" + name + "}", path)
        out.append(a)
    return out


@pytest.fixture
def no_weights(monkeypatch):
    """Loading a model's weights fails the test: bad input is refused before (no progress bar, no wait)."""
    from transformers import AutoModelForCausalLM

    def load(*args, **kwargs):
        pytest.fail("the model's weights were loaded before the input was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)


@pytest.mark.parametrize("argv, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_exit_2(p, capsys, monkeypatch, no_weights, argv, words):
    if "--config" not in argv:  # never the user's store (a config names its own root)
        monkeypatch.setenv("KVSTRATA_STORE_ROOT", str(Path(p["out"]) / "store"))
    try:
        code = main(fill(argv, p))
    except SystemExit as e:  # argparse's refusals exit from the parser
        code = e.code
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("kvstrata")]
    assert code == 2 and "Traceback" not in err
    assert len(said) == 1 and said[0].startswith("kvstrata: error: ") and err.rstrip().endswith(said[0])
    assert fill([words], p)[0] in said[0]
    assert not Path(p["out"], "results.jsonl").exists() and not Path(p["out"], "train_ref.json").exists()
    assert not Path(p["out"], "serve_bench.json").exists()


def test_serve_refuses_a_port_in_use_before_the_model_loads(p, capsys, monkeypatch, no_weights):
    monkeypatch.setenv("KVSTRATA_STORE_ROOT", str(Path(p["out"]) / "store"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(fill([*SERVE, "--port", str(port)], p)) == 2
    err = capsys.readouterr().err
    said = f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"
    assert err == f"kvstrata: error: {said}\n"


def test_env_settings_are_checked_too(p, capsys, monkeypatch):
    monkeypatch.setenv("KVSTRATA_STORE_BLOCK_SIZE", "abc")
    assert main(["store", "stats"]) == 2
    err = "kvstrata: error: KVSTRATA_STORE_BLOCK_SIZE: expected an integer, got 'abc'\n"
    assert capsys.readouterr().err == err


@pytest.mark.parametrize("argv, words", [
    (["generate", "--model", "{llama}", "--prompt-file", "/dev/zero"], "not a regular file"),
    ([*PASSKEY, "--depth", "2.0"], "argument --depth"),
    (["store", "verify", "--config", "{rc}"], "redis_cluster: expected true or false"),
    (["report", "{badrows}"], "bad row(s)"),
    ([*SERVE, "--api-key-file", "/dev/zero"], "not a regular file"),
])
def test_bad_input_through_the_real_entry_point(p, argv, words):
    out = subprocess.run([sys.executable, "-c", "import sys; from kvstrata.cli import main; sys.exit(main())",
                          *fill(argv, p)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT),
                              "KVSTRATA_STORE_ROOT": p["out"] + "/store"})
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvstrata: error: ")
    assert fill([words], p)[0] in out.stderr


def test_report_names_bad_rows_and_skips_them_only_when_asked(tmp_path, capsys):
    good = (ROOT / "docs/results/results.jsonl").read_text().splitlines()[:40]
    bad = ['{"model": "smollm2-135m", "length": 2048, "ta', "[1,2]", "{}",
           json.dumps({**json.loads(good[0]), "score": "abc"})]
    (tmp_path / "results.jsonl").write_text("\n".join(good[:10] + bad[:2] + good[10:] + bad[2:]) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "results.jsonl") in err and "4 bad row(s)" in err
    for line, why in ((11, "not JSON"), (12, "a JSON list"), (43, "field 'model'"), (44, "field 'score'")):
        assert f"line {line}: {why}" in err
    assert not (tmp_path / "report.md").exists()
    assert main(["report", str(tmp_path), "--skip-bad"]) == 0
    assert "**4 malformed row(s) of results.jsonl were skipped**" in (tmp_path / "report.md").read_text()


def test_report_times_its_headline_by_another_run_and_remembers_it(tmp_path, capsys):
    rows = (ROOT / "docs/results/speed-headline/results.jsonl").read_text().splitlines()
    big, fast = tmp_path / "big", tmp_path / "fast"
    for d in (big, fast):
        d.mkdir()
    (big / "results.jsonl").write_text("\n".join(r for r in rows if '"static"' not in r) + "\n")
    (fast / "results.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["report", str(big), "--decode-from", str(tmp_path / "none")]) == 2  # checked before a write
    assert "--decode-from" in capsys.readouterr().err
    assert sorted(p.name for p in big.iterdir()) == ["results.jsonl"]
    assert main(["report", str(big)]) == 0
    own = (big / "headline.md").read_text()
    assert main(["report", str(big), "--decode-from", str(fast)]) == 0
    timed = (big / "headline.md").read_text()
    assert json.loads((big / "meta.json").read_text())["decode_from"] == "../fast"
    assert timed != own  # static is faster than dynamic there: the bar moved
    (big / "headline.md").unlink()
    assert main(["report", str(big)]) == 0 and (big / "headline.md").read_text() == timed  # remembered


def test_allocation_failures_and_long_messages_are_one_clear_line():
    from kvstrata.cli import one_line

    assert one_line(MemoryError()).startswith("out of memory (MemoryError)")
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                       "memory: you tried to allocate 8000000000000 bytes.\nmore detail")
    assert one_line(cpu).startswith("out of memory ([enforce fail") and "\n" not in one_line(cpu)
    assert one_line(ValueError("\n  first line  \nsecond")) == "first line"
