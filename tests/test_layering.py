"""The layers point one way (docs STYLE point 11): speculator is the ground floor and imports
neither decoder nor training; the decoder never imports training; no module imports another's
private (`_name`) names; no import cycles, not even through imports for annotations only (`if
TYPE_CHECKING:`): the modules the decoder drives take it as a protocol (`decoder/sequence.py`
`DecoderParts`, `decoder/loop.py` `LoopParts`). Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"speculator": 0, "decoder": 1, "training": 2}  # a module imports its floor and those below


def modules() -> dict[str, Path]:
    """Module name (e.g. "specboost.decoder.bench.suite") -> its file, for every module of the packages."""
    out = {}
    for package in FLOORS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(("specboost", *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return out


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every specboost import: `from m import name` or `import m`."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specboost"):
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names if alias.name.startswith("specboost"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (`from package import module` counts as the module)."""
    known = modules()
    edges = {name: set() for name in known}
    for name, path in known.items():
        for module, imported in imports(path):
            target = f"{module}.{imported}" if f"{module}.{imported}" in known else module
            if target in known and target != name:
                edges[name].add(target)
    return edges


def test_layers_point_one_way() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if FLOORS[target.split(".")[1]] > FLOORS[name.split(".")[1]]
    ]
    assert wrong == [], "imports from a higher floor (speculator < decoder < training)"


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{name}: from {module} import {imported}"
        for name, path in modules().items()
        for module, imported in imports(path)
        if imported and imported.startswith("_") and not imported.startswith("__")
    ]
    assert private == []


def test_no_import_cycles() -> None:
    edges, state, cycles = graph(), {}, []

    def visit(name: str, path: list[str]) -> None:  # depth first; state 1 = on the path, 2 = done
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []
