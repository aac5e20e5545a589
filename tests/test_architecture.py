"""The controller's shape: calls go downward. No orchestrator module imports one that imports it back (directly
or through others), and none needs a TYPE_CHECKING back-reference to do so."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "orchestrator"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The orchestrator modules a file imports, anywhere in it (function-level imports too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "orchestrator"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "orchestrator":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) for p in files}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    edges = graph()
    assert "orchestrator.loop" in edges and "orchestrator.state" in edges["orchestrator.loop"]
    assert cycles(edges) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_type_checking_back_references():
    users = [p.name for p in PACKAGE.rglob("*.py") if "TYPE_CHECKING" in p.read_text()]
    assert users == []


def test_the_loop_is_at_the_top_and_data_at_the_bottom():
    edges = graph()
    below_loop = {m for m, deps in edges.items() if "orchestrator.loop" in deps}
    assert below_loop <= {"orchestrator.cli", "orchestrator.contract"}  # only entry points use the loop
    for bottom in ("orchestrator.state", "orchestrator.ledger", "orchestrator.noise", "orchestrator.runner"):
        assert not edges[bottom] & {"orchestrator.loop", "orchestrator.trial", "orchestrator.plan",
                                    "orchestrator.workspace"}, bottom
