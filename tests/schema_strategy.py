"""Hypothesis strategies drawing instances of the JSON Schemas that ``broker.schema`` exports.

Covers the keywords pydantic emits for the wire messages. Sizes are capped to keep examples
small; an unknown keyword fails loudly so the strategy can't silently under-test.
"""

from typing import Any

from hypothesis import strategies as st

_HANDLED = {
    "$defs",
    "$id",
    "$ref",
    "$schema",
    "additionalProperties",
    "anyOf",
    "const",
    "default",
    "description",
    "enum",
    "exclusiveMaximum",
    "exclusiveMinimum",
    "format",
    "items",
    "maxItems",
    "maxLength",
    "maxProperties",
    "maximum",
    "minItems",
    "minLength",
    "minimum",
    "pattern",
    "properties",
    "required",
    "title",
    "type",
}
_CAP = 6


def from_json_schema(root: dict[str, Any]) -> st.SearchStrategy[Any]:
    defs = root.get("$defs", {})

    def strategy(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        unknown = set(schema) - _HANDLED
        if unknown:
            raise NotImplementedError(f"schema keywords not handled: {sorted(unknown)}")
        if "$ref" in schema:
            return st.deferred(lambda: strategy(defs[schema["$ref"].rsplit("/", 1)[-1]]))
        if "anyOf" in schema:
            return st.one_of([strategy(s) for s in schema["anyOf"]])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**63) - 1) + 1)
            hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**63) - 1)
            return st.integers(lo, hi)
        if kind == "number":
            return st.floats(
                min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
                exclude_min="exclusiveMinimum" in schema,
                exclude_max="exclusiveMaximum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "string":
            lo, hi = schema.get("minLength", 0), min(schema.get("maxLength", _CAP), _CAP)
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True).filter(
                    lambda s: lo <= len(s) <= schema.get("maxLength", len(s))
                )
            return st.text(min_size=lo, max_size=max(lo, hi))
        if kind == "array":
            lo = schema.get("minItems", 0)
            hi = max(lo, min(schema.get("maxItems", _CAP), _CAP))
            return st.lists(strategy(schema["items"]), min_size=lo, max_size=hi)
        if kind == "object":
            return _object(schema, strategy)
        raise NotImplementedError(f"schema type not handled: {schema!r}")

    return strategy(root)


def _object(schema: dict[str, Any], strategy) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties")
    if props is None:  # a map: additionalProperties is the value schema
        return st.dictionaries(
            st.text(max_size=_CAP),
            strategy(schema["additionalProperties"]),
            max_size=min(schema.get("maxProperties", _CAP), _CAP),
        )
    required = set(schema.get("required", ()))
    fields = {
        name: strategy(sub) if name in required else st.none() | strategy(sub)
        for name, sub in props.items()
    }

    def drop_absent(d: dict[str, Any]) -> dict[str, Any]:
        # st.none() above stands for "absent" on optional fields; a field may also be
        # explicitly null when its own schema allows it (then st.none() comes from anyOf).
        return {k: v for k, v in d.items() if v is not None or k in required}

    return st.fixed_dictionaries(fields).map(drop_absent)
