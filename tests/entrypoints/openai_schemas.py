"""OpenAI's API schemas (``tests/fixtures/openai_openapi``, vendored from openai/openai-openapi) as
``jsonschema`` validators: ``validate(name, obj)`` checks ``obj`` against component schema ``name``.

The document is OpenAPI 3.1, whose schemas are JSON Schema 2020-12, so a ``referencing`` registry holding
the whole vendored document resolves its ``#/components/schemas/...`` references as they are. Five schemas
still carry OpenAPI 3.0's ``nullable: true``, which 2020-12 does not know: they are read as also allowing
null. ``x-`` keys, ``discriminator`` and ``format`` are annotations only."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "openai_openapi" / "schemas.json"
BASE = "urn:openai-openapi"


def _nullable(node):
    """``node`` with OpenAPI 3.0's ``nullable: true`` spelled as JSON Schema (null also allowed)."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def _absolute(node):
    """``node`` with its document-local references (``#/...``) made absolute (``BASE#/...``)."""
    if isinstance(node, list):
        return [_absolute(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _absolute(v) for k, v in node.items()}
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#"):
        out["$ref"] = BASE + out["$ref"]
    return out


@functools.cache
def document() -> dict:
    return _nullable(json.loads(FIXTURE.read_text()))


@functools.cache
def _registry() -> Registry:
    return Registry().with_resource(BASE, Resource.from_contents(document(), default_specification=DRAFT202012))


def schema(name: str) -> dict:
    return document()["components"]["schemas"][name]


def validator(name: str, patch=None) -> jsonschema.Draft202012Validator:
    """A validator of component schema ``name``; ``patch(schema copy)`` first edits it (a documented
    exception, see the tests)."""
    root = {"$ref": f"{BASE}#/components/schemas/{name}"}
    if patch is not None:  # the copy is a document of its own: its references point into the registry's
        root = _absolute(copy.deepcopy(schema(name)))
        patch(root)
    return jsonschema.Draft202012Validator(root, registry=_registry())


def errors(name: str, obj, patch=None) -> list:
    """Every way ``obj`` breaks schema ``name`` (``"path: message"``), empty when it conforms."""
    found = validator(name, patch).iter_errors(obj)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


def stream_event_schema(event_type: str) -> str:
    """The ``ResponseStreamEvent`` member schema for events of ``event_type`` (its ``type`` enum); a
    KeyError when the spec has no such event."""
    for member in schema("ResponseStreamEvent")["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        if schema(name).get("properties", {}).get("type", {}).get("enum") == [event_type]:
            return name
    raise KeyError(event_type)
