"""The import graph flows one way (docs/architecture.md): every module of ``rawpaged/``, the package root
included, sits in one layer; a module imports only its own layer and the layers below it, and no set of
modules imports itself round a circle. Imports inside functions count too; one remains only where it
defers a heavy optional library, and says so (``# deferred: <reason>``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rawpaged"

#: What the server may import from below it.
BELOW_ENTRYPOINTS = {
    "base",
    "face",
    "structured_output",
    "kernels",
    "core",
    "lora",
    "model_executor",
    "weights",
    "spec_decode",
    "engine",
}
#: The folders of entrypoints/, each a layer of its own (``entrypoints.<folder>``).
ENTRYPOINT_FOLDERS = ("server", "http", "generation", "openai", "anthropic", "websocket")
#: Layers from the bottom up, each with the layers below it that it may import. A layer never imports one
#: above it, so each can be read, tested and replaced without those above.
LAYERS = {
    "base": set(),  # errors (and the import of optional libraries), dtypes
    "structured_output": {"base"},
    "face": {"base", "structured_output"},  # config, sampling_params, tokenizer
    "kernels": {"base", "face"},
    "core": {"base", "face"},
    "lora": {"base", "face", "kernels"},  # adapters: PEFT files, their slots, the per-step shrink/expand
    "model_executor": {"base", "face", "kernels", "core", "lora"},
    "weights": {"base", "face", "kernels", "lora", "model_executor"},  # the default model, above the loader
    # proposers, acceptance rule, draft model
    "spec_decode": {"base", "face", "kernels", "core", "lora", "model_executor"},
    "engine": {
        "base",
        "face",
        "structured_output",
        "kernels",
        "core",
        "lora",
        "model_executor",
        "weights",
        "spec_decode",
    },
    "testing": {"base", "face", "kernels"},  # random models, reference sampler, random quantized blocks
    # entrypoints/, folder by folder: the server's state, HTTP plumbing, the shared generation pipeline, the
    # OpenAI APIs and the websocket (each beside the other), and at the top the modules loose in entrypoints/
    "entrypoints.server": BELOW_ENTRYPOINTS,
    "entrypoints.http": BELOW_ENTRYPOINTS | {"entrypoints.server"},
    "entrypoints.generation": BELOW_ENTRYPOINTS | {"entrypoints.server", "entrypoints.http"},
    "entrypoints.openai": BELOW_ENTRYPOINTS | {"entrypoints.server", "entrypoints.http", "entrypoints.generation"},
    "entrypoints.anthropic": BELOW_ENTRYPOINTS | {"entrypoints.server", "entrypoints.http", "entrypoints.generation"},
    "entrypoints.websocket": BELOW_ENTRYPOINTS | {"entrypoints.server", "entrypoints.http", "entrypoints.generation"},
    "entrypoints": BELOW_ENTRYPOINTS | {f"entrypoints.{folder}" for folder in ENTRYPOINT_FOLDERS},
    "package": {"base", "face", "kernels", "lora", "engine", "entrypoints"},  # rawpaged/__init__.py, __main__.py
    "tools": {"base", "face", "kernels", "core", "lora", "model_executor", "weights", "engine", "testing", "package"},
}
#: The package root: the library's face and nothing else.
ROOT_MODULES = {
    "rawpaged": "package",
    "rawpaged.__main__": "package",
    "rawpaged.errors": "base",
    "rawpaged.dtypes": "base",
    "rawpaged.config": "face",
    "rawpaged.sampling_params": "face",
    "rawpaged.pooling_params": "face",
    "rawpaged.tokenizer": "face",
}
DEFERRED = "# deferred:"


def module_names(package: Path) -> dict:
    """Dotted module name -> file, for every ``.py`` file under ``package``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name, or None for a root module that is not the library's face."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "entrypoints" and parts[2] in ENTRYPOINT_FOLDERS:
        return f"entrypoints.{parts[2]}"
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS and parts[1] not in ("base", "face")):
        return parts[1] if parts[1] in LAYERS else None
    return ROOT_MODULES.get(module)


def imports(module: str, path: Path, modules: dict) -> list:
    """(line, imported module of ``modules``, inside a function?) for each import of ``path``, at any depth."""
    is_package = path.name == "__init__.py"
    in_function = set()
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target in modules and target != module:
                found.append((node.lineno, target, id(node) in in_function))
    return found


def import_graph(package: Path) -> dict:
    """Module -> {imported module: (line, inside a function?)} for the rawpaged modules of ``package``."""
    modules = module_names(package)
    graph = {}
    for name, path in modules.items():
        graph[name] = {target: (line, deferred) for line, target, deferred in imports(name, path, modules)}
    return graph


def upward_imports(package: Path) -> list:
    """One line per import of a layer a module may not import, and per module in no layer."""
    bad = []
    for module, targets in import_graph(package).items():
        layer = layer_of(module)
        if layer is None:
            bad.append(f"{module} is in no layer (the package root holds only {sorted(ROOT_MODULES)})")
            continue
        for target, (line, _) in sorted(targets.items()):
            other = layer_of(target)
            if other is not None and other != layer and other not in LAYERS[layer]:
                bad.append(f"{module}:{line} ({layer}) imports {target} ({other})")
    return bad


def circles(package: Path) -> list:
    """The import circles: each strongly connected set of two or more modules (Tarjan), sorted."""
    graph = import_graph(package)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def undeclared_deferred_imports(package: Path) -> list:
    """Imports inside functions with no ``# deferred: <reason>`` on their line or just above their group."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                i = node.lineno - 1
                said = DEFERRED in lines[i]
                while not said and i > 0 and lines[i].strip().startswith(("import ", "from ")):
                    i -= 1
                    said = DEFERRED in lines[i]
                if not said:
                    bad.append(f"{path.relative_to(package.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(bad))


def test_layers_are_ordered():
    order = list(LAYERS)
    for i, layer in enumerate(order):
        assert LAYERS[layer] <= set(order[:i]), f"{layer} may import a layer above it"


def test_no_module_imports_a_layer_above_it():
    assert not upward_imports(PACKAGE), "\n".join(upward_imports(PACKAGE))


def test_no_import_circle():
    assert not circles(PACKAGE), circles(PACKAGE)


def test_imports_inside_functions_say_why():
    assert not undeclared_deferred_imports(PACKAGE), "\n".join(undeclared_deferred_imports(PACKAGE))


def _write(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "rawpaged"


@pytest.mark.parametrize("where", ["top", "function"])
def test_the_checks_find_an_injected_circle_and_upward_import(tmp_path, where):
    """The three checks fail on a tree with a circle, an import up a layer and a stray root module."""
    indent = "def f():\n    " if where == "function" else ""
    package = _write(
        tmp_path,
        {
            "rawpaged/__init__.py": "",
            "rawpaged/errors.py": "",
            "rawpaged/core/__init__.py": "",
            "rawpaged/core/a.py": f"{indent}from rawpaged.core import b\n",
            "rawpaged/core/b.py": f"{indent}import rawpaged.core.a\n",
            "rawpaged/core/c.py": f"{indent}from rawpaged.engine.x import run\n",
            "rawpaged/engine/__init__.py": "",
            "rawpaged/engine/x.py": "from rawpaged.errors import E\n",
            "rawpaged/stray.py": "",
        },
    )
    assert circles(package) == [["rawpaged.core.a", "rawpaged.core.b"]]
    assert upward_imports(package) == [
        "rawpaged.core.c:" + ("2" if where == "function" else "1") + " (core) imports rawpaged.engine.x (engine)",
        f"rawpaged.stray is in no layer (the package root holds only {sorted(ROOT_MODULES)})",
    ]
    assert len(undeclared_deferred_imports(package)) == (3 if where == "function" else 0)


def test_the_checks_find_an_upward_import_between_entrypoints_folders(tmp_path):
    """Plumbing that imports a route, the pipeline that imports the app, and the websocket that imports an
    OpenAI API are each refused; an API importing the pipeline is not."""
    package = _write(
        tmp_path,
        {
            "rawpaged/__init__.py": "",
            "rawpaged/entrypoints/__init__.py": "",
            "rawpaged/entrypoints/api_server.py": "from rawpaged.entrypoints.openai.chat import serving\n",
            "rawpaged/entrypoints/http/__init__.py": "",
            "rawpaged/entrypoints/http/body.py": "from rawpaged.entrypoints.openai.chat.serving import f\n",
            "rawpaged/entrypoints/generation/__init__.py": "",
            "rawpaged/entrypoints/generation/writer.py": "import rawpaged.entrypoints.api_server\n",
            "rawpaged/entrypoints/openai/__init__.py": "",
            "rawpaged/entrypoints/openai/chat/__init__.py": "",
            "rawpaged/entrypoints/openai/chat/serving.py": "from rawpaged.entrypoints.generation import writer\n",
            "rawpaged/entrypoints/websocket/__init__.py": "",
            "rawpaged/entrypoints/websocket/serving.py": "from rawpaged.entrypoints.openai.chat import serving\n",
        },
    )
    assert upward_imports(package) == [
        "rawpaged.entrypoints.generation.writer:1 (entrypoints.generation) imports rawpaged.entrypoints.api_server"
        " (entrypoints)",
        "rawpaged.entrypoints.http.body:1 (entrypoints.http) imports rawpaged.entrypoints.openai.chat.serving"
        " (entrypoints.openai)",
        "rawpaged.entrypoints.websocket.serving:1 (entrypoints.websocket) imports"
        " rawpaged.entrypoints.openai.chat.serving (entrypoints.openai)",
    ]
    assert layer_of("rawpaged.entrypoints.http") == "entrypoints.http"
    assert layer_of("rawpaged.entrypoints.cli") == "entrypoints"


def test_nothing_below_the_entrypoints_knows_http():
    for path in PACKAGE.rglob("*.py"):
        if "entrypoints" in path.parts:
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        assert not names & {"aiohttp", "pydantic"}, path
