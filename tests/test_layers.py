"""The package's import graph: no circles, and every import goes down the declared layers.

Layers, top to bottom (a module may import its own layer and the ones below it, never above):
the CLI parses and calls ``runtime.launch``; the demo and ``verify`` drive jobs; ``job`` is the
description users write (its ``run()`` hands it to the runtime); ``runtime`` composes
savepoints, checkpoints, sinks and sources; ``savepoint`` works on checkpoints; checkpoints,
sinks, sources and the Spark session helpers sit on the ground of storage, errors and process
helpers. Every ``import`` counts, also inside functions and under ``TYPE_CHECKING``: a lazy
import hides a circle from Python, not from this test. A package's ``__init__`` re-exporting
its own submodules is not an edge.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

LAYERS: list[list[str]] = [
    ["onceflow.cli", "onceflow.__main__"],
    ["onceflow.demo", "onceflow.verify"],
    ["onceflow.job"],
    ["onceflow.runtime"],
    ["onceflow.savepoint"],
    ["onceflow.checkpoint", "onceflow.sinks", "onceflow.sources", "onceflow.spark", "onceflow.jvm_cache"],
    ["onceflow.storage", "onceflow.errors", "onceflow.durations", "onceflow.process", "onceflow.outages",
     "onceflow.faults", "onceflow.kafka_client", "onceflow.extras", "onceflow"],
]


def modules(root: pathlib.Path = SRC) -> dict[str, pathlib.Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(name: str, f: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``f``) imports, anywhere in it."""
    pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                target = next((c for c in (f"{mod}.{alias.name}", mod) if c in known), None)
                if target:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    out.discard(name)
    if f.name == "__init__.py":
        out = {d for d in out if not d.startswith(name + ".")}
    return out


def graph(root: pathlib.Path = SRC) -> dict[str, set[str]]:
    known = {m: f for m, f in modules(root).items() if m.split(".")[0] == "onceflow"}
    return {m: imports(m, f, known) for m, f in known.items()}


def layer(module: str) -> int:
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return found


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(graph()) == []


def test_imports_go_down_the_layers():
    g = graph()
    upward = sorted(f"{a} -> {b}" for a, deps in g.items() for b in deps if layer(b) < layer(a))
    assert upward == [], "imports against the layer order:\n" + "\n".join(upward)


def test_cli_modules_do_not_import_each_other():
    g = graph()
    crossing = sorted(f"{a} -> {b}" for a, deps in g.items() if a.startswith("onceflow.cli.")
                      for b in deps if b.startswith("onceflow.cli.") and a != "onceflow.cli.main")
    assert crossing == []


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "onceflow"
    (pkg / "sinks").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sinks" / "__init__.py").write_text("")
    (pkg / "sinks" / "a.py").write_text("def f():\n    from onceflow.runtime import b\n")
    (pkg / "runtime").mkdir()
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "b.py").write_text("from onceflow.sinks.a import f\n")
    g = graph(tmp_path)
    assert circles(g) == [["onceflow.runtime.b", "onceflow.sinks.a"]]
    assert layer("onceflow.runtime.b") < layer("onceflow.sinks.a")  # so a -> b goes up
