"""`kvstrata report` over the committed rows writes exactly the committed report: every file it
writes (tables, headline, HTML, plots) byte for byte. A refactor that changes a number, a
rounding or a plot shows up here."""

import json
import shutil
from pathlib import Path

import pytest

from kvstrata_lab.bench.report import write_report

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


@pytest.mark.parametrize("results", [RESULTS, RESULTS / "transfer"], ids=["ruler", "transfer"])
def test_the_committed_report_is_what_the_report_command_writes(tmp_path, results):
    out = tmp_path / "results"
    shutil.copytree(results, out)
    timed = json.loads((results / "meta.json").read_text()).get("decode_from")
    if timed:  # the headline's decode column comes from a sibling speed run: copied beside it
        shutil.copytree(results / timed, out / timed)
    written = [p for p in out.iterdir() if p.suffix in (".md", ".html", ".png")]
    assert {"report.md", "headline.md", "report.html"} <= {p.name for p in written}
    for p in written:  # the report's own files go, so each must be written anew
        p.unlink()
    write_report(out)
    changed = [p.name for p in written if not p.exists() or p.read_bytes() != (results / p.name).read_bytes()]
    assert changed == [], f"kvstrata report no longer writes the committed {changed}"
