"""The package tree is the architecture: layers, lowest first, and every import goes downward (or stays within
its layer). Parsed from the source, function-level imports included, so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "orchestrator"
# lowest first; a module may import from its own layer and the layers below it
LAYERS = ["store", "trust", "executors", "proposers", "core", "views", "trackers", "entry"]
SHARED = {"orchestrator", "orchestrator.plugins"}  # LoopError and the plugin loader: importable from anywhere


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS[:-1] else "entry"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "template" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path) -> set[str]:
    """The orchestrator modules `module` imports (a `from pkg import name` counts name when it is a module)."""
    known = modules()
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("orchestrator"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("orchestrator"):
                target = node.module
            else:
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            found.update(name for name in names if name in known)
            if not any(name in known for name in names):
                found.add(target)
    return {name for name in found if name != module}


def test_the_layers_are_packages_and_every_import_goes_downward():
    found = modules()
    assert set(LAYERS[:-1]) <= {m.split(".")[1] for m in found if m.count(".") >= 1}, "a layer package is missing"
    upward = []
    for module, path in found.items():
        mine = LAYERS.index(layer_of(module))
        for target in imports_of(module, path):
            if target in SHARED or target.split(".")[0] != "orchestrator":
                continue
            if LAYERS.index(layer_of(target)) > mine:
                upward.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not upward, "imports that climb a layer:\n" + "\n".join(upward)


def test_the_shared_modules_import_nothing_of_the_package():
    found = modules()
    for module in SHARED:
        assert imports_of(module, found[module]) <= SHARED, module


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a store module that imports the loop is reported."""
    path = tmp_path / "ledger.py"
    path.write_text("from ..core import state\ndef f():\n    from ..views.report import table\n")
    assert imports_of("orchestrator.store.ledger", path) == {"orchestrator.core.state", "orchestrator.views.report"}
