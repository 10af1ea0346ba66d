"""Closed objects: a JSON Schema's objects admit only the properties they declare, unless they say otherwise.

The JSON Schema spec leaves an object open (any further key) unless it says
`"additionalProperties": false`, and llguidance follows the spec. Schemas from pydantic,
LangChain and most tools never say it, so under the spec a model may add keys after the
declared ones and the object need not close before max_tokens. vLLM's default engines
(xgrammar, outlines) close such objects, and its llguidance backend has an option to do the
same. Here it is the default (STRUCTURED_OPEN_OBJECTS=1 restores the spec):

- an object schema that declares `properties` (or `patternProperties`) and says nothing of
  `additionalProperties` / `unevaluatedProperties` gets `"additionalProperties": false`;
- one that says `additionalProperties: true`, or gives a schema for the extra keys, keeps them;
- an object that declares no properties (`{"type": "object"}`, a dict) stays open: closing it
  would allow only `{}`;
- members of `allOf`, and schemas that have one, are left as they are: each member declares
  only its own properties, so closing members would refuse the keys the others declare.
"""

from typing import Any

# Keywords whose value is one subschema, a map of names to subschemas, or a list of subschemas.
_ONE = ("additionalProperties", "unevaluatedProperties", "items", "contains", "not", "if", "then", "else")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` with its objects closed as the module says (the input is left unchanged)."""
    return _close(schema, closable=True)


def _close(schema: Any, closable: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false, or something the engine will refuse
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], True)
    if isinstance(out.get("items"), list):  # the older tuple form of prefixItems
        out["items"] = [_close(s, True) for s in out["items"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, True) for name, s in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, True) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, False) for s in out["allOf"]]
        closable = False
    declares = "properties" in out or "patternProperties" in out
    says = "additionalProperties" in out or "unevaluatedProperties" in out
    if closable and declares and not says:
        out["additionalProperties"] = False
    return out
