"""Deep schemas moved into ``$defs``: the result is shallow enough for llguidance's JSON reader and
means the same (checked with ``jsonschema``, an independent validator, on valid and invalid instances);
schemas whose references a move could break are left alone."""

from __future__ import annotations

import pytest

pytest.importorskip("jsonschema")  # absent on some hosts (the GPU host has no package index)

import json

import jsonschema

from rawpaged.structured_output.json_schema import MAX_DEPTH, hoist_deep_subschemas, json_depth


def nested(levels: int, leaf=None) -> dict:
    s = leaf or {"type": "string", "maxLength": 3}
    for i in range(levels):
        key = "a" if i % 2 else "b"
        s = {"type": "object", "properties": {key: s, "n": {"type": "integer"}}, "required": [key]}
        if i % 3 == 0:
            s = {"anyOf": [s, {"type": "array", "items": {"type": "null"}, "maxItems": 1}]}
    return s


def instance(schema, value="ok"):
    """A valid value for ``nested``'s schemas, by following the first branch."""
    if "anyOf" in schema:
        return instance(schema["anyOf"][0], value)
    if schema.get("type") == "object":
        key = schema["required"][0]
        return {key: instance(schema["properties"][key], value)}
    return value


def validator(schema):
    return jsonschema.Draft202012Validator(schema)


def test_json_depth():
    assert [json_depth(v) for v in (1, {}, [], {"a": [1]}, [[{}]])] == [0, 1, 1, 2, 3]


@pytest.mark.parametrize("levels", [10, 60, 150])
def test_deep_schemas_become_shallow_and_mean_the_same(levels):
    schema = nested(levels)
    out = hoist_deep_subschemas(schema)
    assert json_depth(out["$defs"] if "$defs" in out else out) <= MAX_DEPTH + 8
    assert all(json_depth(d) <= MAX_DEPTH + 4 for d in out.get("$defs", {}).values())
    if json_depth(schema) <= MAX_DEPTH:
        assert out is schema
    good = instance(schema)
    bad_leaf = instance(schema, "toolong")
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # jsonschema recurses once per level
    try:
        assert validator(schema).is_valid(good) and validator(out).is_valid(good)
        assert not validator(schema).is_valid(bad_leaf) and not validator(out).is_valid(bad_leaf)
        assert not validator(out).is_valid({"zzz": 1})
    finally:
        sys.setrecursionlimit(limit)
    json.dumps(out)  # plain JSON


def test_existing_defs_and_root_refs_are_kept():
    tree = {"$ref": "#/$defs/node"}
    schema = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": tree}}}}}
    schema["properties"] = {"root": nested(40, {"$ref": "#"})}
    out = hoist_deep_subschemas(schema)
    assert out["$defs"]["node"] == schema["$defs"]["node"]
    assert any(k.startswith("rawpaged_nested_") for k in out["$defs"])


@pytest.mark.parametrize(
    "ref",
    ["#/properties/x", "#/$defs/a/properties/b", "other.json#/x", "#anchor"],
)
def test_schemas_with_pointer_refs_are_left_alone(ref):
    schema = nested(80, {"$ref": ref})
    assert hoist_deep_subschemas(schema) is schema


def test_data_keywords_are_not_rewritten():
    value = {"properties": {"x": {"properties": {"y": {}}}}}  # data that looks like a schema
    out = hoist_deep_subschemas(nested(60, {"enum": [value], "default": value}))
    found, stack = [], [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "enum" in node:
                found.append(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    assert found == [{"enum": [value], "default": value}]


# ------------------------------------------------------------------------------------------ strict objects
STRICT_CASES = [  # (schema, instance with an unlisted key, instance without)
    (
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"city": "P", "x": 1},
        {"city": "P"},
    ),
    (
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
        {"a": {"b": 1, "c": 2}},
        {"a": {"b": 1}},
    ),
    (
        {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        [{"n": 1}, {"n": 2, "m": 3}],
        [{"n": 1}, {"n": 2}],
    ),
    (
        {"anyOf": [{"type": "object", "properties": {"p": {"type": "string"}}}, {"type": "integer"}]},
        {"p": "x", "q": "y"},
        {"p": "x"},
    ),
    (
        {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}}}, "$ref": "#/$defs/pt"},
        {"x": 1, "y": 2},
        {"x": 1},
    ),
    ({"type": "object", "properties": {"t": {"type": "array", "prefixItems": [{"type": "object", "properties": {}}]}}},
     {"t": [{"k": 1}]}, {"t": [{}]}),
]  # fmt: skip


@pytest.mark.parametrize("schema, extra, plain", STRICT_CASES)
def test_strict_objects_refuse_unlisted_keys_and_keep_listed_ones(schema, extra, plain):
    from rawpaged.structured_output.json_schema import no_additional_properties

    strict = no_additional_properties(schema)
    jsonschema.validate(extra, schema)  # by the letter of JSON Schema, any other key is fine
    jsonschema.validate(plain, strict)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(extra, strict)
    assert "additionalProperties" not in json.dumps(schema)  # the input is not changed


def test_strict_objects_keep_what_a_schema_says_and_leave_data_alone():
    from rawpaged.structured_output.json_schema import no_additional_properties

    said = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
            "typed": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
            "data": {"const": {"type": "object", "properties": {}}, "default": {"properties": {}}},
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            "unevaluated": {"properties": {"a": {}}, "unevaluatedProperties": False},
        },
    }
    strict = no_additional_properties(said)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and props["typed"]["additionalProperties"] == {
        "type": "integer"
    }
    assert props["data"] == said["properties"]["data"]  # enum / const / default values are data
    assert props["both"] == said["properties"]["both"]  # allOf members would forbid each other's keys
    assert "additionalProperties" not in props["unevaluated"]
    jsonschema.validate({"both": {"a": 1, "b": 2}}, strict)
    jsonschema.validate({"open": {"a": 1, "z": 2}, "typed": {"a": 1, "z": 2}}, strict)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"typed": {"z": "not an integer"}}, strict)
