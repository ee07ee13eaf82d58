"""JSON Schemas made fit for the grammar engine.

- A schema nested deeper than its JSON reader takes (llguidance reads with serde_json, which stops at 128
  levels of arrays and objects) has its deep subschemas moved into ``$defs`` and referenced from where
  they were. The schema means the same: JSON Schema's ``$ref`` to a ``$defs`` entry is that entry's schema
  (2020-12, section 8.2.4).
- Strict objects (``no_additional_properties``): an object schema that lists its ``properties`` and says
  nothing of other keys admits only those, as xgrammar (vLLM's default backend) compiles schemas and as
  OpenAI's strict structured outputs require; by the letter of JSON Schema it would admit any other key,
  and a small model invents keys until ``max_tokens``.
"""

from __future__ import annotations

#: keywords whose value maps names to subschemas
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keywords whose value is a list of subschemas
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
#: keywords whose value is one subschema (``items`` may also be a list: draft 4's tuple form)
SCHEMA_VALUES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
#: JSON nesting depth of each ``$defs`` entry after hoisting (well under serde_json's 128, leaving room
#: for the grammar the schema is embedded in)
MAX_DEPTH = 48
HOISTED_PREFIX = "rawpaged_nested_"


def json_depth(obj) -> int:
    """Levels of arrays and objects in ``obj`` (a scalar: 0; ``{}`` and ``[]``: 1)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _movable(schema: dict) -> bool:
    """Whether subschemas can move without changing what any reference points to: every ``$ref`` is the
    root (``#``) or a whole root ``$defs``/``definitions`` entry, and nothing sets a base URI or anchor."""
    stack = [(schema, True)]
    while stack:
        node, at_root = stack.pop()
        if isinstance(node, dict):
            if not at_root and ("$id" in node or "id" in node and isinstance(node["id"], str)):
                return False
            if "$anchor" in node or "$dynamicRef" in node or "$dynamicAnchor" in node or "$recursiveRef" in node:
                return False
            ref = node.get("$ref")
            if ref is not None:
                if not isinstance(ref, str):
                    return False
                head, _, name = ref.partition("/")[2].partition("/")
                if ref != "#" and not (
                    ref.startswith("#/") and head in ("$defs", "definitions") and name and "/" not in name
                ):
                    return False
            stack.extend((v, False) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, False) for v in node)
    return True


def hoist_deep_subschemas(schema, max_depth: int = MAX_DEPTH):
    """``schema`` with every subschema that sits ``max_depth`` levels deep moved into the root's ``$defs``
    (as ``rawpaged_nested_<i>``) and replaced by a ``$ref`` to it, so that no part is nested deeper than
    about ``max_depth``. Returned unchanged when it is not deep, not an object, or uses references that a
    move could break (JSON pointers into a subschema, ``$id``, anchors)."""
    if not isinstance(schema, dict) or json_depth(schema) <= max_depth or not _movable(schema):
        return schema
    defs: dict = {}
    queue: list = []

    def hoist(node: dict) -> dict:
        name = f"{HOISTED_PREFIX}{len(defs)}"
        while name in schema.get("$defs", {}):
            name += "_"
        defs[name] = None  # its place, filled when the queue reaches it
        queue.append((name, node))
        return {"$ref": f"#/$defs/{name}"}

    def rewrite(node, depth: int):
        if not isinstance(node, dict):
            return node
        if depth >= max_depth:
            return hoist(node)
        out = {}
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: rewrite(v, depth + 2) for k, v in value.items()}
            elif key in SCHEMA_LISTS and isinstance(value, list):
                out[key] = [rewrite(v, depth + 2) for v in value]
            elif key in SCHEMA_VALUES and isinstance(value, list):
                out[key] = [rewrite(v, depth + 2) for v in value]
            elif key in SCHEMA_VALUES:
                out[key] = rewrite(value, depth + 1)
            else:  # a value that is data (enum, const, default, ...), kept as it is
                out[key] = value
        return out

    root = rewrite(schema, 0)
    while queue:
        name, node = queue.pop()
        defs[name] = rewrite(node, 2)  # a $defs entry sits 2 levels down
    root["$defs"] = {**root.get("$defs", {}), **defs}
    return root


def no_additional_properties(schema):
    """A copy of ``schema`` in which every object schema with a ``properties`` map and neither
    ``additionalProperties`` nor ``unevaluatedProperties`` gets ``"additionalProperties": false``. Only
    subschema positions are visited (``enum``, ``const``, ``default`` and ``examples`` values are data),
    and the direct members of an ``allOf`` are left as written: each would forbid the keys the others
    list. A schema that says ``additionalProperties`` (true, false or a schema) keeps it."""

    def strict(node, in_all_of: bool = False):
        if isinstance(node, list):
            return [strict(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                out[key] = {name: strict(v) for name, v in node[key].items()}
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                out[key] = [strict(v, in_all_of=key == "allOf") for v in node[key]]
        for key in SCHEMA_VALUES:
            if key in node:
                out[key] = strict(node[key])
        lists_properties = isinstance(node.get("properties"), dict)
        says = "additionalProperties" in node or "unevaluatedProperties" in node
        if lists_properties and not says and not in_all_of:
            out["additionalProperties"] = False
        return out

    return strict(schema)
