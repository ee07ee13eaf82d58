"""Step 1 of a generation request: its body from bytes to a checked request model. JSON decoding at any
depth, lone UTF-16 surrogates, fields the API does not define, and pydantic's errors as a
:class:`ProtocolError` that names the field. The models themselves are ``protocol``'s."""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ValidationError

from rawpaged.entrypoints.generation.protocol import GenerationRequest
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits

logger = logging.getLogger("rawpaged.server")

_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list"}
# Field -> what it must be, for messages clearer than a union's first member's complaint.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "stop_token_ids": "a list of non-negative integers",
    "messages": "a non-empty list of {role, content} objects",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def decode_json(data: bytes | str, what: str = "request body"):
    """JSON text as Python objects, for any nesting Python's parser takes (pydantic's stops at a few
    hundred levels, which a deeply nested JSON Schema reaches).

    Raises:
        ProtocolError: invalid JSON or UTF-8, nesting too deep, or a string with a lone UTF-16
            surrogate (``"\\ud800"``: no Unicode text; the tokenizer could not encode it).
    """
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ProtocolError(f"{what} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"{what} is not valid JSON: {e}") from None
    bad = _lone_surrogate(obj)
    if bad is not None:
        path = ".".join(str(p) for p in bad) or what
        raise ProtocolError(
            f"{path} holds a lone UTF-16 surrogate (such as \\ud800): not valid Unicode text",
            param=str(bad[0]) if bad else None,
        )
    return obj


def _lone_surrogate(obj) -> list | None:
    """The path of the first string (or key) that is not valid Unicode, or None."""
    stack = [(obj, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(node, dict):
            for k, v in node.items():
                stack.append((k, path))
                stack.append((v, [*path, k]))
        elif isinstance(node, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(node))
    return None


def unknown_fields(model: type[BaseModel], body) -> list:
    """Top-level keys of ``body`` that ``model`` does not define (they would be ignored): those not in its
    ``body_fields`` where it names them (a request that reads only some of the shared fields)."""
    if not isinstance(body, dict):
        return []
    known = getattr(model, "body_fields", None) or (
        set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    )
    return sorted(k for k in body if k not in known)


def parse_request(model: type[GenerationRequest], data, limits: Limits) -> GenerationRequest:
    """A request body (bytes/str of JSON, or an already decoded object) as ``model`` (a
    ``GenerationRequest`` or another request model with ``check(limits)``, such as
    ``openai.tokenize.protocol``'s), checked (``check``). Fields the API does not define are ignored and
    logged, or refused with ``limits.reject_unknown_fields``. Raises ProtocolError naming the field at
    fault; the model's ``expected_types`` (field -> what it must be) word a wrong type's message, and its
    ``body_fields``, where it has them, are the fields it reads from a body, in the order their errors are
    told."""
    body = decode_json(data) if isinstance(data, (bytes, str)) else data
    unknown = unknown_fields(model, body)
    if unknown and limits.reject_unknown_fields:
        raise ProtocolError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} (--reject-unknown-fields)",
            param=unknown[0],
        )
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e, getattr(model, "expected_types", {}), getattr(model, "body_fields", ())) from None
    if unknown:
        logger.warning("request fields %s are not part of the API and were ignored", ", ".join(map(repr, unknown)))
    req.check(limits)
    return req


def _position(field, field_order: tuple) -> int:
    return field_order.index(field) if field in field_order else len(field_order)


def _validation_error(e: ValidationError, expected_types: dict, field_order: tuple = ()) -> ProtocolError:
    """The first of ``e``'s errors, in ``field_order`` where it is given (else the model's), as a
    ProtocolError naming its field."""
    errors = e.errors(include_url=False)
    if field_order:  # a stable sort: the errors of one field stay in pydantic's order
        errors.sort(key=lambda err: _position(err["loc"][0] if err["loc"] else None, field_order))
    err = errors[0]
    if err["type"] == "json_invalid":
        return ProtocolError(f"request body is not valid JSON: {err['msg']}")
    # pydantic names the union member it tried ("str", "list[int]") in the location: not a field.
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    if not loc:
        return ProtocolError("request body must be a JSON object")
    param = loc[0]
    if err["type"] == "missing":
        return ProtocolError(f"{'.'.join(loc)} is required", param=param)
    got = json.dumps(err.get("input"), default=str)[:100]
    expected = expected_types.get(param) or _EXPECTED.get(param)
    if expected and len(loc) == 1:
        return ProtocolError(f"{param} must be {expected}, got {got}", param=param)
    return ProtocolError(f"{'.'.join(loc)}: {err['msg']}, got {got}", param=param)
