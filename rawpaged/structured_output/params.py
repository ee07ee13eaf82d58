"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from rawpaged.errors import InvalidRequestError

#: the constraint kinds, exactly one of which a request sets
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    Attributes:
        json: a JSON Schema (a dict, or its JSON text): the output is a JSON value valid against it.
        regex: the output matches this regular expression (Rust ``regex`` syntax, as llguidance takes it).
        choice: the output is one of these strings.
        grammar: a context-free grammar in Lark syntax or llama.cpp's GBNF.
        json_object: True: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).
    and:
        disable_any_whitespace: JSON without free whitespace (``{"a": 1, "b": [2, 3]}`` spacing), so a small
            model cannot pad with whitespace until ``max_tokens``. On by default here (vLLM's default is
            off); False allows the whitespace JSON allows.
    Raises:
        InvalidRequestError (a ValueError) naming ``structured_outputs`` when none or several kinds are
        set or one has the wrong type.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple | list | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self):
        name = "structured_outputs"
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"{name} must set exactly one of {', '.join(KINDS)}, got {set_kinds or 'none'}", name
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(f"{name}.json must be a JSON Schema object or its JSON text", f"{name}.json")
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name}.{field} must be a non-empty string", f"{name}.{field}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(f"{name}.choice must be a non-empty list of strings", f"{name}.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False) or not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(f"{name}.json_object and disable_any_whitespace must be booleans", name)

    @property
    def kind(self) -> str:
        """The constraint's kind (one of ``KINDS``)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable key of the constraint (the compile cache's key): kind, canonical spec, whitespace."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            try:
                value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
            except (TypeError, ValueError):
                pass  # not JSON: the compiler reports it
        return (self.kind, value, self.disable_any_whitespace)
