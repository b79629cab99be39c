"""What a newcomer sees of a bench run: plot labels that never overlap, a headline that says why it is
empty, timings marked when the machine was busy, and Ctrl-C as one line that says what was kept."""

import json

import pytest

from kvstrata.cli import main
from kvstrata_lab.bench.labels import place_labels
from kvstrata_lab.bench.report import markdown, no_headline
from kvstrata_lab.bench.results import busy, load_note, summarise


def test_labels_never_overlap_even_where_points_coincide():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    # the quick bench's crowd: three 4-bit codecs at one spot, eviction rows on top of each other
    pts = [(6000, 0.67, "int2:r=32"), (6000, 0.67, "mxfp4"), (6000, 0.67, "nvfp4"), (6500, 0.33, "streaming"),
           (6500, 0.33, "snapkv:keep=0.28"), (6400, 0.34, "snapkv:keep=0.53"), (23000, 0.67, "bf16"),
           (46000, 0.67, "dynamic"), (12000, 0.75, "fp8")]
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    ax.set_xscale("log")
    fig.tight_layout()
    texts = place_labels(ax, pts)
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in texts]
    assert sorted(t.get_text() for t in texts) == sorted(p[2] for p in pts)
    clashes = [(a.get_text(), b.get_text()) for i, (a, ba) in enumerate(zip(texts, boxes))
               for b, bb in zip(texts[i + 1:], boxes[i + 1:]) if ba.overlaps(bb)]
    assert clashes == []
    assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1) for b in boxes)
    plt.close(fig)


def row(method, index, load, task="single", score=1.0):
    return dict(model="m", length=2048, method=method, task=task, index=index, score=score,
                family="reference", kv_bytes_per_token=100.0, compression=1.0, failure=None, prefill_s=1.0,
                compress_s=0.1, decode_s_per_token=0.01, peak_rss_mb=100.0, bytes_read_per_step=1000.0,
                load_1m=load, cores=2)


def test_timings_on_a_busy_machine_are_marked_and_the_load_is_said():
    rows = [row("bf16", i, 0.9) for i in range(3)]
    rows += [row("fp8", i, load) for i, load in enumerate((0.8, 7.5, 1))]
    assert [busy(r) for r in rows] == [False] * 4 + [True, False]
    assert not busy({**rows[4], "load_1m": None}) and not busy({**rows[4], "cores": None})
    note = load_note(rows)
    assert "2 cores): median 0.9, max 7.5" in note and "1 of 6 rows were timed on a busy machine" in note
    assert load_note([{k: v for k, v in r.items() if k != "load_1m"} for r in rows]) == ""
    table = {line.split("|")[1].strip(): line for line in markdown(summarise(rows)).splitlines()
             if line.startswith("| `")}
    assert "0.010†" in table["`fp8`"] and "†" not in table["`bf16`"]


def test_a_run_without_headline_cells_says_why_instead_of_an_empty_table():
    said = no_headline(summarise([row("bf16", 0, 0.5), row("dynamic", 0, 0.5)]))
    assert said.startswith("No headline: ") and "m 2,048 (with `dynamic`)" in said and "|" not in said
    assert "summary.md" in said


def test_ctrl_c_in_bench_is_one_line_saying_what_was_kept(tmp_path, monkeypatch, capsys):
    from kvstrata_lab.bench import runner

    def interrupted(cfg, load_model=None):
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "results.jsonl").write_text("".join(json.dumps({"n": i}) + "\n" for i in range(3)))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    code = main(["bench", "--model", "tiny-llama@128", "--methods", "bf16", "--tasks", "single",
                 "--out", str(tmp_path / "b")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 130 and "Traceback" not in "\n".join(err)
    assert err == [f"kvstrata bench: interrupted; 3 finished rows kept in {tmp_path / 'b' / 'results.jsonl'} "
                   "(the cell under way is redone); rerun the same command to resume"]


@pytest.mark.parametrize("spec, warned", [("nvfp4;sliding=fp8", True), ("nvfp4", False)])
def test_a_sliding_recipe_on_a_model_without_sliding_layers_is_said_once(capsys, spec, warned):
    from kvstrata.models import check_method

    check_method("tiny-llama", spec)
    check_method("tiny-gemma3", spec)  # has sliding layers: nothing to say
    err = capsys.readouterr().err.splitlines()
    assert err == ([f"kvstrata: warning: {spec!r} gives sliding-window layers a recipe of their own, but "
                    "tiny-llama has none: every layer runs 'nvfp4'"] if warned else [])
