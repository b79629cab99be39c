import json
import re

import pytest

from kvstrata.cli import main
from kvstrata.models.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("m") / "tiny-llama", "llama"))


def test_generate_json(tiny_dir, capsys):
    assert main(["generate", "--model", tiny_dir, "--method", "mxfp4", "--prompt",
                "hello there", "--max-new-tokens", "4", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    for key in ("text", "method", "model", "context_tokens", "kv_bytes_per_token", "kv_bytes_per_token_bf16"):
        assert key in row
    assert row["method"] == "mxfp4" and row["context_tokens"] == 11
    # tiny llama: 4 layers x 2 x 2 heads x 32 dims -> bf16 1024 B/token, mxfp4 4 x 2 x 2 x 17 = 272
    assert row["kv_bytes_per_token_bf16"] == 1024 and row["kv_bytes_per_token"] == 272


def test_generate_text_and_prompt_file(tiny_dir, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("abc")
    assert main(["generate", "--model", tiny_dir, "--prompt-file", str(f), "--max-new-tokens", "2"]) == 0
    assert "B/token" in capsys.readouterr().err


def test_generate_profile_lists_time_then_kvstrata_by_total(tiny_dir, capsys):
    argv = ["generate", "--model", tiny_dir, "--method", "nvfp4+topk:k=4,window=2", "--prompt", "hello there "
                                                                                                "" * 8,
            "--max-new-tokens", "3", "--profile", "5"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("ncalls") == 2  # self-time listing, then ours by total time
    ours = [line for line in err.split("ncalls")[2].splitlines()[1:] if re.match(r"\s+\d", line)]
    assert ours and all(re.search(r"kvstrata[/\\](read|hf|codecs)", line) for line in ours), ours


def test_bad_method_fails_before_loading(capsys):
    assert main(["generate", "--model", "tiny-llama", "--method", "fp5", "--prompt", "x"]) == 2
    assert "unknown method 'fp5'" in capsys.readouterr().err
    # both wrong: the model is named first, from the catalog alone (no torch: a typo answers at once)
    assert main(["generate", "--model", "/nonexistent", "--method", "fp5", "--prompt", "x"]) == 2
    assert "--model: '/nonexistent' is neither a known model" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--model", "nosuch@2048"], "'nosuch' is neither a known model"),
    (["--model", "smollm2-135m@2k"], "--model smollm2-135m@2k: context length '2k'"),
    (["--lengths", "2048,-1"], "--lengths: context length '-1'"),
])
def test_bench_refuses_bad_models_and_lengths_before_it_starts(tmp_path, capsys, argv, words):
    assert main(["bench", *argv, "--out", str(tmp_path / "run")]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


def test_report_on_a_directory_without_results_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no benchmark results" in capsys.readouterr().err


def test_methods_and_models_list(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    from kvstrata.methods import METHODS

    for name in METHODS:  # every registered method, whatever its stratum
        assert name in out
    assert main(["models"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_method_lists_split_between_specs_not_inside_them():
    from kvstrata.cli.inputs import split_methods

    text = ("bf16,nvfp4:rot=hadamard;layers[17-18,20]=fp8;layers[11]=int2:r=32,rot=hadamard,layers[0-3]=fp8,"
            "int2:r=32,group=8,full=fp8;sliding=bf16")
    tuned = "nvfp4:rot=hadamard;layers[17-18,20]=fp8;layers[11]=int2:r=32,rot=hadamard"
    expected = ["bf16", tuned, "layers[0-3]=fp8", "int2:r=32,group=8", "full=fp8;sliding=bf16"]
    assert split_methods(text) == expected
