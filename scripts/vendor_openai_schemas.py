"""Extract the OpenAI API schemas the server's shape tests validate against (tests/entrypoints/test_openai_spec.py)
from OpenAI's OpenAPI document (github.com/openai/openai-openapi, ``openapi.json``) into
``tests/fixtures/openai_openapi/schemas.json``: the named component schemas and every schema they ``$ref``,
transitively, under ``components.schemas`` (so the ``#/components/schemas/...`` references resolve unchanged).

    python scripts/vendor_openai_schemas.py /path/to/openapi.json [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the top-level schemas the tests validate responses against
ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "Response",
    "ResponseStreamEvent",
    "ErrorResponse",
)
PREFIX = "#/components/schemas/"
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "openai_openapi" / "schemas.json"


def _refs(node) -> set:
    """The component schema names ``node`` refers to (anywhere inside it)."""
    found: set = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref[len(PREFIX) :])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def extract(document: dict, roots=ROOTS) -> dict:
    """``{name: schema}`` of ``roots`` and their transitive ``$ref`` closure. Raises KeyError naming a
    schema the document lacks."""
    schemas = document["components"]["schemas"]
    todo, out = list(roots), {}
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = schemas[name]
        todo.extend(sorted(_refs(out[name]) - out.keys()))
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("openapi", type=Path, help="openai-openapi's openapi.json")
    ap.add_argument("--commit", default="f85dbe223d40e1a31cba812ab2d755c7e98a92a3", help="its commit (recorded)")
    args = ap.parse_args()
    document = json.loads(args.openapi.read_text())
    vendored = {
        "source": f"https://github.com/openai/openai-openapi/blob/{args.commit}/openapi.json",
        "openapi": document["openapi"],
        "components": {"schemas": extract(document)},
    }
    OUT.write_text(json.dumps(vendored, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {len(vendored['components']['schemas'])} schemas")


if __name__ == "__main__":
    main()
