"""entrypoints/ is grouped by role and by API (docs/architecture.md, "The server's layout"): few modules
loose at its top, each OpenAI API a folder with its protocol and serving module, file names that say
their job, request models and the serve parser small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

ENTRYPOINTS = Path(__file__).resolve().parents[2] / "rawpaged" / "entrypoints"
#: the app, its launcher, the operations routes, the command line and the offline LLM
TOP_MODULES = {"__init__.py", "api_server.py", "launcher.py", "health.py", "cli.py", "llm.py"}
API_FOLDERS = ("chat_completion", "completion", "responses", "tokenize")
MAX_REQUEST_MODEL_LINES = 300
MAX_FUNCTION_LINES = 60


def request_model_files() -> list:
    """The files that define a pydantic request model (a class over ``BaseModel`` or ``OpenAIBaseModel``
    or another request)."""
    found = []
    for path in sorted(ENTRYPOINTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and any(b.endswith(("BaseModel", "Request")) for b in bases):
                found.append(path)
                break
    return found


def function_lines(path: Path, name: str) -> int:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{name} not in {path}")


def test_few_modules_are_loose_at_the_top():
    assert {p.name for p in ENTRYPOINTS.glob("*.py")} == TOP_MODULES


def test_each_api_is_a_folder_with_its_protocol_and_serving_module():
    for api in API_FOLDERS:
        folder = ENTRYPOINTS / "openai" / api
        assert (folder / "protocol.py").is_file() and (folder / "serving.py").is_file(), folder


def test_file_names_say_their_job_not_response():
    names = [p.relative_to(ENTRYPOINTS) for p in ENTRYPOINTS.rglob("*.py") if "response" in p.stem]
    assert not names, names


def test_the_websocket_request_lives_with_the_websocket():
    text = (ENTRYPOINTS / "websocket" / "protocol.py").read_text()
    assert "class WebSocketGenerateRequest(" in text
    others = [p for p in ENTRYPOINTS.rglob("*.py") if "class WebSocketGenerateRequest(" in p.read_text()]
    assert others == [ENTRYPOINTS / "websocket" / "protocol.py"]


def test_request_model_files_are_small():
    files = request_model_files()
    assert len(files) >= 6, files  # the shared fields, chat messages, four APIs' requests, the websocket's
    sizes = {str(p.relative_to(ENTRYPOINTS)): len(p.read_text().splitlines()) for p in files}
    assert all(n <= MAX_REQUEST_MODEL_LINES for n in sizes.values()), sizes


def test_the_serve_parser_fits_on_a_screen():
    assert function_lines(ENTRYPOINTS / "cli.py", "build_serve_parser") <= MAX_FUNCTION_LINES
