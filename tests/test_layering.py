"""The import graph flows one way (docs/architecture.md): entrypoints -> engine -> core / model_executor
-> kernels. A module never imports a layer above its own, so each layer can be read, tested and replaced
without those above it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rawpaged"
#: Layer -> the layers it must not import.
FORBIDDEN = {
    "core": {"engine", "entrypoints", "model_executor", "kernels"},
    "kernels": {"core", "engine", "entrypoints", "model_executor"},
    "model_executor": {"engine", "entrypoints"},
    "engine": {"entrypoints"},
    "structured_output": {"core", "engine", "entrypoints", "model_executor"},
}


def imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_one_above_it(layer):
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "rawpaged" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not bad, "\n".join(bad)


def test_nothing_below_the_entrypoints_knows_http():
    for path in PACKAGE.rglob("*.py"):
        if "entrypoints" in path.parts:
            continue
        names = imported_modules(path)
        assert not {n for n in names if n.split(".")[0] in ("aiohttp", "pydantic")}, path
