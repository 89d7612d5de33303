"""The house's import contract: data flows one way, no package imports one above it, no import circle.

Every `import` counts, at module level, inside a function (a lazy import is a
circle all the same) or under `if TYPE_CHECKING:` (a name a module needs only for
its annotations is still a dependency a reader must follow). The graph is drawn from the source of the installed layout
(`tokenload/`, plus `analysis/` and `locustfiles/` installed as
`tokenload.analysis` and `tokenload.locustfiles`, as pyproject.toml maps them),
so the check needs no import of the code and sees the folders the way Python does.

LAYERS is the contract ARCHITECTURE.md describes: top to bottom, a package may
import only from packages on lower lines; packages on one line are independent
of each other. The one exception is the package root (`tokenload/__init__.py`,
the public API): it names for type checkers what it imports on first use. A new module or package must be placed here (the test fails on
one it does not know), which is the point: say where it sits before it grows.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tokenload.compat import tomllib

ROOT = Path(__file__).resolve().parent.parent

LAYERS: list[list[str]] = [
    ["tokenload.__main__"],
    ["tokenload.cli"],
    ["tokenload.commands", "tokenload.locustfiles"],
    ["tokenload.history", "tokenload.webui"],
    ["tokenload.load"],
    ["tokenload.doctor", "tokenload.analysis", "tokenload.sim"],
    ["tokenload.search", "tokenload.servermetrics"],
    ["tokenload.transport", "tokenload.workload"],
    ["tokenload.stream"],
    ["tokenload.protocols"],
    ["tokenload.deltas", "tokenload.sse", "tokenload.limits", "tokenload.tokens"],
    ["tokenload.failures", "tokenload.measure", "tokenload.channel", "tokenload.dayclock", "tokenload.slo",
     "tokenload.exporter", "tokenload.thresholds"],
    ["tokenload.record", "tokenload.errors", "tokenload.compat", "tokenload.rundir", "tokenload.modelsize",
     "tokenload.protocolspec", "tokenload.contracts", "tokenload.quantiles"],
    ["tokenload"],  # the package's own __init__: the public API, imported on first use by name only
]
# Packages whose lines are at most this share of the project's Python (issue: no folder above ~25%).
MAX_SHARE = 0.25


def source_roots() -> dict[str, Path]:
    """Installed package name -> folder, from pyproject.toml's package list and its package-dir map."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapped = config.get("package-dir", {})
    return {name: ROOT / mapped.get(name, name.replace(".", "/")) for name in config["packages"]}


def modules() -> dict[str, Path]:
    """Every module of the installed layout, by dotted name."""
    out: dict[str, Path] = {}
    for package, folder in source_roots().items():
        for path in folder.glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (each resolved to the longest known module name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.add(dotted)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                resolve(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def room(module: str) -> str:
    """The contract's package a module belongs to (the longest LAYERS entry that contains it)."""
    names = [n for line in LAYERS for n in line if module == n or module.startswith(n + ".")]
    return max(names, key=len) if names else module


def rank() -> dict[str, int]:
    return {name: i for i, line in enumerate(LAYERS) for name in line}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_the_graph_sees_every_package_and_lazy_imports() -> None:
    edges = graph()
    assert {"tokenload.analysis.pipeline", "tokenload.locustfiles.llm", "tokenload.load.plugin",
            "tokenload.workload.scenario", "tokenload.transport.gevent_client"} <= set(edges)
    # control.py imports doctor inside a function (it is heavy): it must be seen all the same
    assert "tokenload.doctor" in edges["tokenload.load.control"]
    # and a TYPE_CHECKING import too (store.py names the Channel only for its annotations)
    assert "tokenload.channel" in edges["tokenload.history.store"]
    assert all(not m.startswith("locust") for m in edges["tokenload.load.tokenstats"])  # only the project's


def test_no_import_circle_anywhere() -> None:
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_place_in_the_layers() -> None:
    ranks = rank()
    unplaced = sorted(m for m in graph() if room(m) not in ranks)
    assert not unplaced, f"modules outside the contract (add their package to LAYERS): {unplaced}"


def test_imports_only_go_down_the_layers() -> None:
    ranks = rank()
    wrong: list[str] = []
    for module, targets in graph().items():
        if module == "tokenload":  # the public API: its TYPE_CHECKING names are what it loads on first use
            continue
        here = room(module)
        for target in targets:
            there = room(target)
            if here == there:
                continue
            if ranks[there] <= ranks[here]:  # LAYERS lists the top first
                side = "beside" if ranks[there] == ranks[here] else "above"
                wrong.append(f"{module} -> {target} ({there} is {side} {here})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_package_docstrings_name_their_job() -> None:
    missing = [name for name, folder in source_roots().items()
               if (folder / "__init__.py").exists() and ast.get_docstring(
                   ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) is None
               and name not in ("tokenload.scenarios", "tokenload.locustfiles")]
    assert not missing, f"packages without an __init__ docstring: {missing}"


def test_no_package_holds_more_than_a_quarter_of_the_code() -> None:
    lines: dict[str, int] = defaultdict(int)
    for name, path in modules().items():
        lines[room(name)] += len(path.read_text(encoding="utf-8").splitlines())
    for package, folder in source_roots().items():  # compiled sources count with their package
        lines[room(package)] += sum(len(p.read_text(encoding="utf-8").splitlines()) for p in folder.glob("*.c"))
    total = sum(lines.values())
    over = {k: round(v / total, 3) for k, v in lines.items() if v / total > MAX_SHARE}
    assert not over, f"packages above {MAX_SHARE:.0%} of {total} lines: {over}"


def test_a_circle_and_an_upward_import_are_caught() -> None:
    """The checks themselves: a made-up graph with one of each is refused."""
    edges = {"tokenload.load.a": {"tokenload.load.b"}, "tokenload.load.b": {"tokenload.load.a"}}
    assert cycles(edges) == [["tokenload.load.a", "tokenload.load.b"]]
    ranks = rank()
    assert ranks[room("tokenload.workload.scenario")] > ranks[room("tokenload.load.control")]  # workload is below
