"""The package's shape: each folder is one layer, and imports only run downward.

    options  <-  kernels  <-  checkpoint  <-  ipc  <-  preloadd, worker  <-  bench  <-  cli, preload

and inside worker/: model <- engine <- api <- the process (attach, link, llm, serve).
The daemon and the worker never import each other; the one exception is the zygote,
the place in preloadd/ that runs worker code (in the processes it forks, never in the
daemon). Every import counts, those inside functions too; only imports under
`if TYPE_CHECKING:` (types for annotations) are left out. Modules import no cycle.
No product file is longer than 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = [p for p in ROOT.rglob("*.py") if not {".venv", "tests", "build", "scripts"} & set(p.relative_to(ROOT).parts)]

# (module prefix, rank): a module may import modules of a lower rank, or of its own unit.
LAYERS = [
    ("preload.options", 0),
    ("preload.kernels", 1),
    ("preload.checkpoint", 2),
    ("preload.ipc", 3),
    ("preload.preloadd", 4),
    ("preload.worker.model", 4.1),
    ("preload.worker.engine", 4.2),
    ("preload.worker.api", 4.3),
    ("preload.worker", 4.4),
    ("preload.bench", 5),
    ("preload.cli", 6),
    ("preload", 6),  # the package's face: `from preload import LLM`
]
SIBLINGS = {frozenset({"preload.preloadd", "preload.worker"})}  # same rank, never each other
EXCEPTIONS = {("preload.preloadd.zygote_process", "preload.worker")}  # the zygote runs worker code


def module_name(path: Path) -> str:
    parts = ["preload", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> tuple[str, float]:
    """The layer a module belongs to: the longest matching prefix."""
    matches = [(p, r) for p, r in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=lambda m: len(m[0]))


def imports(path: Path) -> set[str]:
    """preload modules imported anywhere in the file, except for type checking only."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from preload.x import y` names module preload.x, or y when y is a submodule
            found |= {f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                      for a in node.names}
    return {m for m in found if m == "preload" or m.startswith("preload.")}


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


GRAPH = {module_name(p): imports(p) for p in CODE}


def allowed(src: str, dst: str) -> bool:
    (su, sr), (du, dr) = unit(src), unit(dst)
    if su == du or any(src.startswith(a) and dst.startswith(b) for a, b in EXCEPTIONS):
        return True
    top = lambda u: ".".join(u.split(".")[:2])  # noqa: E731
    if frozenset({top(su), top(du)}) in SIBLINGS:
        return False
    return dr < sr


def test_the_layers_cover_every_module():
    assert len(GRAPH) > 40
    for module in GRAPH:
        assert unit(module), module


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_run_downward(module):
    wrong = sorted(dst for dst in GRAPH[module] if not allowed(module, dst))
    assert not wrong, f"{module} ({unit(module)[0]}) imports upward or sideways: {wrong}"


def test_the_check_itself_catches_upward_and_sideways_imports():
    assert not allowed("preload.kernels.rope", "preload.checkpoint.config")
    assert not allowed("preload.ipc.identity", "preload.worker.tokenizer")
    assert not allowed("preload.preloadd.daemon", "preload.worker.serve")
    assert not allowed("preload.worker.attach", "preload.preloadd.loader")
    assert not allowed("preload.worker.engine.engine", "preload.worker.api.app")
    assert allowed("preload.preloadd.zygote_process", "preload.worker.serve")
    assert not allowed("preload.preloadd.zygote", "preload.worker.serve")  # (its handle, in the daemon)
    assert allowed("preload.cli.start", "preload.preloadd.daemon")


def test_no_import_cycles():
    def visit(module: str, path: list[str]) -> None:
        for dst in sorted(GRAPH.get(module, ())):
            if dst in path:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dst):] + [dst]))
            if dst not in done:
                visit(dst, path + [dst])
        done.add(module)

    done: set[str] = set()
    for module in sorted(GRAPH):
        visit(module, [module])


@pytest.mark.parametrize("path", sorted(CODE), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_product_file_exceeds_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 500, f"{path.relative_to(ROOT)}: {lines} lines"
