"""The import graph keeps the layering the package layout shows: no cycles, no import from a higher
stratum into a lower one, imports at module top (outside the CLI) unless a comment says why, and
the library importing nothing from the lab (`lab/kvstrata_lab`: benchmark, tuner, evidence)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstrata"
LAB = ROOT / "lab" / "kvstrata_lab"
# Rank of each top-level part of the package: a module may import its own rank or lower ones only.
RANKS = {
    "registry": 0, "knobs": 0, "names": 0, "settings": 0, "user_files": 0,  # leaves: no kvstrata imports
    "codecs": 1, "keep": 1,  # store and keep strata
    "read": 2, "kvstrata": 2,  # read stratum; the package root registers codecs, keep and read
    "methods": 3,  # the spec grammar over every stratum's registered methods
    "hf": 4, "models": 4,  # transformers integration; real, tiny and V4.1 models
    "accounting": 5, "place": 5,  # bytes per layer from a cache; the place stratum (store, tiers)
    "serve": 6,  # the OpenAI-compatible server
    "vllm": 6,  # the vLLM KV connector over the store (its own environment)
    "cli": 7,
}  # fmt: skip
# Where a kvstrata import may sit inside a function: the CLI imports a subcommand's modules when it
# runs, so `kvstrata --help` does not load transformers.
LAZY_OK = ("kvstrata.cli", "kvstrata_lab.cli")
# Modules imported only where used because they need an optional dependency.
OPTIONAL = {"kvstrata.read.kernels.triton_decode": "triton (GPU kernels)",
            "kvstrata.read.kernels.triton_varlen": "triton (GPU kernels)",
            "kvstrata.vllm.connector": "vllm (its own environment)"}


def module_name(path: Path) -> str:
    base = LAB.parent if LAB in path.parents else PACKAGE.parent
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


LIBRARY = {module_name(p): p for p in PACKAGE.rglob("*.py")}
MODULES = LIBRARY | {module_name(p): p for p in LAB.rglob("*.py")}


def stratum(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The kvstrata modules an import statement loads (a name imported from a package that is a
    module counts as that module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported module, line, inside a function)]."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        nested = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in targets(node, module, path.name == "__init__.py"):
                    edges.append((t, node.lineno, id(node) in nested))
        graph[module] = edges
    return graph


GRAPH = imports()


def test_every_part_of_the_package_has_a_rank():
    assert {stratum(m) for m in LIBRARY} <= set(RANKS), "give the new part of kvstrata a rank in RANKS"


def test_no_import_from_a_higher_stratum():
    upward = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
        for m, edges in GRAPH.items()
        if m in LIBRARY
        for t, line, _ in edges
        if RANKS[stratum(t)] > RANKS[stratum(m)]
    ]
    assert not upward, "\n".join(upward)


def test_the_library_imports_nothing_from_the_lab():
    """Not at module top, not inside a function, not by any spelling the import statement allows."""
    found = []
    for module, path in LIBRARY.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] == "kvstrata_lab"]
        if "kvstrata_lab" in path.read_text().replace("`kvstrata_lab", "").replace("kvstrata-lab", ""):
            found += [f"{path.relative_to(ROOT)} names kvstrata_lab (importlib or a string import?)"]
    assert not found, "\n".join(found)
    assert "kvstrata_lab.bench.tune" in MODULES  # the walk sees the lab


def test_no_import_cycle():
    """Depth-first search over module-level and function-level imports alike."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t, _, _ in GRAPH[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_own_modules_are_imported_at_module_top():
    lazy = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} inside a function"
        for m, edges in GRAPH.items()
        if not m.startswith(LAZY_OK)
        for t, line, inside in edges
        if inside and t not in OPTIONAL
    ]
    assert not lazy, "\n".join(lazy)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from kvstrata.place import tier", ["kvstrata.place.tier"]),
        ("from kvstrata.codecs import NVFP4", ["kvstrata.codecs"]),
        ("import kvstrata.hf.cache", ["kvstrata.hf.cache"]),
        ("from .segments import Segment", ["kvstrata.hf.segments"]),
    ],
)
def test_imports_resolve_to_modules(source, expected):
    """The walker itself: a check that resolves imports wrongly would pass anything."""
    assert targets(ast.parse(source).body[0], "kvstrata.hf.layers", False) == expected


def test_imports_inside_functions_say_why():
    """Outside the CLI an import inside a function needs a reason in a comment beside it (an optional
    dependency, a heavy module loaded only when used)."""
    silent = []
    for module, path in MODULES.items():
        if module.startswith(LAZY_OK):
            continue
        lines = path.read_text().split("\n")
        tree = ast.parse("\n".join(lines))
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    near = lines[node.lineno - 2 : node.end_lineno]
                    if not any("#" in line for line in near):
                        silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not silent, "imports inside functions without a reason: " + ", ".join(sorted(set(silent)))
