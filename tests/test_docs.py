"""The docs cannot drift from the code: every Python block of README.md and docs/*.md runs, every CLI
subcommand and every registered method is documented, and docs/methods.md is what
`kvstrata methods --markdown` prints today."""

import re
from pathlib import Path

import pytest

from kvstrata.cli import build_parser
from kvstrata.cli.methods_doc import markdown
from kvstrata.methods import METHODS
from kvstrata_lab.serve_bench.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


AFTER_FIRST = "after the first block"  # README: a block whose first line says so uses block 1's names


def readme_runs(blocks: list[str]) -> list[tuple[int, bool]]:
    """How the README says its blocks run: (index, continues the first block's namespace)."""
    return [(i, AFTER_FIRST in code.split("\n", 1)[0]) for i, code in enumerate(blocks)]


@pytest.mark.integration
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    """Blocks of a docs page run in order in one namespace (later blocks use earlier names); the
    README's run as it says: each alone, but those marked `after the first block` in a copy of the first
    block's namespace. The serving page's and README's client talks to a real SmolLM2 server started
    here (its URL in KVSTRATA_URL)."""
    monkeypatch.chdir(tmp_path)
    server = None
    if page.name in ("serving.md", "README.md"):
        server = ServerProcess("smollm2-135m", "--method", "nvfp4", name="smollm2-135m",
                               env={"KVSTRATA_STORE_ROOT": str(tmp_path / "store")}).start()
        monkeypatch.setenv("KVSTRATA_URL", server.base_url)
    blocks = python_blocks(page)
    first: dict = {"__name__": "__docs__"}
    namespace = first
    try:
        for i, code in enumerate(blocks):
            if page.name == "README.md" and i:
                namespace = dict(first) if readme_runs(blocks)[i][1] else {"__name__": "__docs__"}
            exec(compile(code, f"{page.name}[python block {i + 1}]", "exec"), namespace)  # noqa: S102 - our docs
    finally:
        if server is not None:
            server.kill()
    assert capsys.readouterr().out.strip(), f"{page.name}: the blocks printed nothing"


def names(code: str) -> tuple[set[str], set[str]]:
    """(names a block binds, by assignment or import; names it reads)."""
    import ast

    tree = ast.parse(code)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    return bound, {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def test_the_readme_says_which_blocks_continue_the_first():
    """Every README block but the first either runs alone or says it continues the first; a standalone
    one reads nothing only the first block binds (checked without running them: they load models)."""
    blocks = python_blocks(ROOT / "README.md")
    first = names(blocks[0])[0]
    runs = readme_runs(blocks)
    assert any(after for _, after in runs) and not runs[0][1]
    for i, after in runs[1:]:
        bound, read = names(blocks[i])
        borrowed = (read - bound) & first
        assert after or not borrowed, f"README block {i + 1} uses {sorted(borrowed)} from the first block"
        assert not after or borrowed, f"README block {i + 1} says it continues the first but needs nothing"


def test_a_standalone_readme_block_runs_alone(capsys):
    """One of them, run for real in a fresh namespace: the tensor block (no model)."""
    [code] = [b for b in python_blocks(ROOT / "README.md") if "kvstrata.quantize(" in b]
    exec(compile(code, "README.md[one tensor]", "exec"), {"__name__": "__docs__"})  # noqa: S102 - our docs
    assert "bytes instead of" in capsys.readouterr().out


def test_the_openai_example_prints_a_miss_then_a_hit(tmp_path, monkeypatch, capsys):
    """The README's OpenAI block, alone, against a real server (a tiny Llama with a chat template served
    under the block's model name, one token per byte): its shared system prompt is longer than a store
    block, so the first question is a miss and the second a hit with whole blocks cached."""
    from kvstrata.models.tiny import save_tiny

    [code] = [b for b in python_blocks(ROOT / "README.md") if "OpenAI(" in b]
    model = save_tiny(tmp_path / "tiny-chat", "llama", chat_template=True)
    with ServerProcess(str(model), name="smollm2-135m", log_path=tmp_path / "serve.log",
                       env={"KVSTRATA_STORE_ROOT": str(tmp_path / "store")}) as server:
        monkeypatch.setenv("KVSTRATA_URL", server.base_url)
        exec(compile(code, "README.md[openai]", "exec"), {"__name__": "__docs__"})  # noqa: S102 - our docs
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [kind for _, kind in printed] == ["miss", "hit"]
    assert int(printed[0][0]) == 0 and int(printed[1][0]) >= 256 and int(printed[1][0]) % 256 == 0
    assert "# 0 miss, then 256 hit" in code  # what the block says it prints (on SmolLM2)


def test_every_subcommand_is_documented():
    text = "\n".join(p.read_text() for p in PAGES)
    subcommands = build_parser()._subparsers._group_actions[0].choices
    missing = [s for s in subcommands if f"kvstrata {s}" not in text]
    assert missing == [], f"subcommands no page shows: {missing}"


def test_readme_counts_the_subcommands():
    n = len(build_parser()._subparsers._group_actions[0].choices)
    assert f"lists all {n} subcommands" in (ROOT / "README.md").read_text()


def test_every_method_is_documented():
    page = (ROOT / "docs" / "methods.md").read_text()
    assert [m for m in METHODS if f"| `{m}` |" not in page] == []


def test_methods_page_is_generated():
    assert (ROOT / "docs" / "methods.md").read_text() == markdown(), \
        "docs/methods.md is stale: kvstrata methods --markdown > docs/methods.md"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250
    assert [i + 1 for i, line in enumerate(lines) if len(line) > 200] == [], "README lines over 200 chars"
    headings = [line for line in lines if line.startswith("## ")]
    # the spec table on the first screen, right after the two commands
    assert headings[:2] == ["## Two commands", "## Which spec should I use"]
    table = text[text.index("## Which spec should I use"):text.index("## Python tour")]
    assert len([line for line in table.splitlines() if line.startswith("| `")]) >= 5
    assert text.index("```python") < text.index("## Results")  # code before tables


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()]


def test_readme_headline_is_the_reports():
    """The README shows the report's headline table cell for cell, its column titles without the
    cell legend (which the text above it gives), so no line runs past 200 characters."""
    text = (ROOT / "README.md").read_text()
    path = re.search(r"<!-- headline: (docs/results/\S*headline\.md) -->\n", text)
    assert path, "README has no <!-- headline: docs/results/.../headline.md --> marker"
    table = _rows((ROOT / path[1]).read_text())
    start = path.end()
    shown = _rows(text[start : text.index("<!-- /headline -->")])
    legend = ": ×smaller / retrieval / decode ×fastest stock"
    assert shown[0] == [c.removesuffix(legend) for c in table[0]] and all(legend in c for c in table[0][1:])
    assert shown[1:] == table[1:]


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_architecture_walk_names_real_functions():
    page = (ROOT / "docs" / "architecture.md").read_text()
    names = sorted(set(re.findall(r"`(kvstrata(?:_lab)?\.[\w.]+)`", page)))
    assert len(names) >= 40
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert missing == [], f"docs/architecture.md names what does not exist: {missing}"
    for room in ("## One decode step", "## One served request"):
        assert room in page
