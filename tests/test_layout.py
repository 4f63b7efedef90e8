"""The package's layout rules, read from the source (every import, also those inside functions).

- the rank side (vramwatch.rank, vramwatch.integrations) and the server side (vramwatch.server) do not
  import each other: they meet only through vramwatch.spool;
- vramwatch.monitoring (the contract, alerts, dashboards) imports neither side;
- the alert rules and the dashboards do not import each other: what both need (the PromQL helpers, the
  dashboard ids) lives below them in vramwatch.monitoring, and those shared modules import neither;
- no import cycles between the package's modules.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vramwatch"

RANK_SIDE = ("vramwatch.rank", "vramwatch.integrations")
SERVER_SIDE = ("vramwatch.server",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _known(name: str) -> str | None:
    """``name`` or its nearest enclosing module of the package (``a.b.attr`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported package module, line) for every import in ``module``'s source, at any depth."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _within(source, ("vramwatch",)):
                continue
            for alias in node.names:
                # `from pkg import name` imports the submodule pkg.name when there is one
                sub = f"{source}.{alias.name}"
                target = sub if sub in MODULES else _known(source)
                if target is not None:
                    yield target, node.lineno


@functools.cache
def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: first line}; built when a test asks (each xdist worker collects this
    file, and parsing the whole package is ~0.7 s of CPU that only the worker running it needs)."""
    graph: dict[str, dict[str, int]] = {}
    for m in MODULES:
        graph[m] = {}
        for target, line in imports(m):
            if target != m:
                graph[m].setdefault(target, line)
    return graph


def _where(module: str, target: str) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{_graph()[module][target]}"


def _crossings(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{_where(m, t)}: {m} imports {t}"
        for m in _graph()
        if _within(m, importers)
        for t in _graph()[m]
        if _within(t, forbidden)
    ]


def test_the_rank_side_does_not_import_the_server_side() -> None:
    assert _crossings(RANK_SIDE, SERVER_SIDE) == []


def test_the_server_side_does_not_import_the_rank_side() -> None:
    assert _crossings(SERVER_SIDE, RANK_SIDE) == []


def test_monitoring_imports_neither_side() -> None:
    assert _crossings(("vramwatch.monitoring",), RANK_SIDE + SERVER_SIDE) == []


ALERTS = ("vramwatch.monitoring.alerts",)
# the dashboards' CLI takes the shared --config argument from the alerts' CLI: one command line beside another
DASHBOARDS = tuple(m for m in MODULES if _within(m, ("vramwatch.monitoring.dashboards",)) and not m.endswith(".cli"))
SHARED_BELOW = ("vramwatch.monitoring.promql", "vramwatch.monitoring.dashboard_ids")


def test_alerts_and_dashboards_do_not_import_each_other() -> None:
    assert _crossings(ALERTS, DASHBOARDS) == []
    from_dashboards = [
        f"{_where(m, t)}: {m} imports {t}" for m in DASHBOARDS for t in _graph()[m] if _within(t, ALERTS)
    ]
    assert from_dashboards == []


def test_what_alerts_dashboards_and_helm_share_imports_none_of_them() -> None:
    above = (*ALERTS, "vramwatch.monitoring.dashboards", "vramwatch.monitoring.helm")
    assert _crossings(SHARED_BELOW, above) == []


def _cycles() -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of the graph.

    Importing a submodule runs its package's __init__ first, so the edge package -> child (the
    __init__ importing its own submodule) is how packages work, not a cycle; it is left out.
    """

    def edges(m: str) -> list[str]:
        return [t for t in _graph()[m] if not (_is_package(m) and t.startswith(m + "."))]

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in edges(m):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for m in sorted(_graph()):
        if m not in index:
            visit(m)

    def path_back(start: str, members: set[str]) -> list[str]:
        # breadth-first within the component: the shortest way from start back to start
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier:
            nxt = []
            for m in frontier:
                for t in edges(m):
                    if t not in members:
                        continue
                    if t == start:
                        path = [m]
                        while path[-1] != start:
                            path.append(previous[path[-1]])
                        return [start, *reversed(path[:-1]), start]
                    if t not in previous:
                        previous[t] = m
                        nxt.append(t)
            frontier = nxt
        raise AssertionError(f"no cycle through {start}")

    return [path_back(c[0], set(c)) for c in components]


def test_no_import_cycles() -> None:
    described = [
        " -> ".join(cycle) + "\n    " + ", ".join(_where(a, b) for a, b in zip(cycle, cycle[1:], strict=False))
        for cycle in _cycles()
    ]
    assert not described, "import cycles:\n  " + "\n  ".join(described)


def test_the_graph_sees_imports_inside_functions() -> None:
    # the cli imports its subcommands' modules only when they run
    assert "vramwatch.docs" in _graph()["vramwatch.cli"]
    assert "vramwatch.server.main" in _graph()["vramwatch.cli"]


# --- no test depends on where the virtualenv lives ---
# this file names what it looks for, so it is left out
TEST_SOURCES = sorted(
    p for p in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "harness").rglob("*.py")] if p != Path(__file__).resolve()
)
_RUNNERS = {"run", "Popen", "check_call", "check_output", "call", "execv", "execvp"}
# an interpreter or tool named by a path or a bare name resolves to whichever install PATH or the checkout
# has; sys.executable (or harness.tool() for the stack's binaries) is the one running the tests
_BARE = {"python", "python3", "pytest", "vramwatch", "ruff", "mypy", "pip"}


def venv_assumptions(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ".venv" in node.value:
            yield node.lineno, f"names .venv: {node.value!r}"
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if func in _RUNNERS and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
                first = node.args[0].elts[0] if node.args[0].elts else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    name = first.value
                    if name in _BARE or "/bin/" in name:
                        yield node.lineno, f"runs {name!r}: use sys.executable (-m ...)"


def test_no_test_assumes_where_the_virtualenv_is():
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in TEST_SOURCES for line, what in venv_assumptions(p)]
    assert not found, "\n".join(found)


def test_the_venv_check_sees_what_it_looks_for(tmp_path):
    bad = tmp_path / "t.py"
    bad.write_text(
        'import subprocess\nsubprocess.run([".venv/bin/python", "-m", "vramwatch"])\nsubprocess.run(["pytest", "-q"])\n'
    )
    assert sorted(line for line, _ in venv_assumptions(bad)) == [2, 2, 3]
