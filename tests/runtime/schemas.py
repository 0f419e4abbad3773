"""An independent check of a JSON value against the JSON Schema keywords the structured-output tests
use (jsonschema is not a dependency): type, enum, const, properties, required, additionalProperties,
items, minItems, maxItems, minimum, maximum, minLength, maxLength, anyOf, and $ref to the root's $defs. Unknown keywords fail, so
a test cannot lean on one this does not check."""

from __future__ import annotations

from typing import Any

TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
KNOWN = {
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "anyOf",
    "description",
    "title",
    "$ref",
    "$defs",
}


def errors(value: Any, schema: dict, where: str = "$", root: dict | None = None) -> list[str]:
    """What in `value` breaks `schema` (empty: it validates); `root`: the schema whose `$defs` a
    `$ref` names (`schema` itself at the top)."""
    unknown = set(schema) - KNOWN
    assert not unknown, f"the checker does not know {unknown}"
    root = schema if root is None else root
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/") and ref.count("/") == 2, f"the checker does not follow {ref}"
        return errors(value, root["$defs"][ref.rsplit("/", 1)[1]], where, root)
    out: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(TYPES[k](value) for k in kinds):
            return [f"{where}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r} != {schema['const']!r}")
    if "anyOf" in schema and all(errors(value, s, where, root) for s in schema["anyOf"]):
        out.append(f"{where}: {value!r} matches none of anyOf")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {k!r} is missing" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], f"{where}.{k}", root)
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: {k!r} is not allowed")
    if isinstance(value, list):
        if "items" in schema:
            for i, v in enumerate(value):
                out += errors(v, schema["items"], f"{where}[{i}]", root)
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{where}: {len(value)} items")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        out.append(f"{where}: length {len(value)}")
    if TYPES["number"](value):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{where}: {value} out of range")
    return out
