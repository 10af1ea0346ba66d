"""The grammars of tool calls in a reply (constraint kinds tool_auto and tool_calls), in llguidance's Lark.

    tool_auto    JSON {"trigger": str, "schema": {...}, "separator"?: str}: free text that may not
                 contain `trigger`; once the text writes `trigger`, a call follows (one JSON value of
                 `schema`); with `separator`, after each call the reply may write it and one more
                 call (parallel calls), or end. Without, the grammar ends after the first call.
    tool_calls   JSON {"schema": {...}, "separator": str}: the reply is one call or more, `separator`
                 between two (a forced reply: tool_choice "required" with parallel calls).

The calls are written compactly (", " and ": ", no other whitespace), as the json_schema kind
without a whitespace pattern writes them, so a small model cannot loop on whitespace.
"""

import json
from typing import Any

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolGrammarError(ValueError):
    """A tool_auto / tool_calls spec that is not what the kind takes; the message says what."""


def tool_lark(kind: str, spec: str, close: Any) -> str:
    """The Lark grammar of a tool_auto or tool_calls spec; `close` maps the call schema to the one
    the grammar holds calls to (closing its objects, or not)."""
    assert kind in ("tool_auto", "tool_calls"), kind
    keys = '{"trigger": str, "schema": {...}, "separator"?: str}' if kind == "tool_auto" else ""
    keys = keys or '{"schema": {...}, "separator": str}'
    try:
        value = json.loads(spec)
        schema, separator = value["schema"], value.get("separator")
        trigger = value["trigger"] if kind == "tool_auto" else None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ToolGrammarError(f"a {kind} constraint is JSON {keys}") from None
    if not isinstance(schema, dict) or not _text_or_none(separator) or not _text_or_none(trigger):
        raise ToolGrammarError(f"{kind}: schema must be an object, trigger and separator non-empty strings")
    if kind == "tool_calls" and separator is None:
        raise ToolGrammarError("tool_calls: a separator is required (one call alone is a json_schema constraint)")
    calls = "call" if separator is None else f"call ({json.dumps(separator)} call)*"
    lines = [f"start: {calls}"]
    if trigger is not None:
        lines = [
            f"start: TEXT | head {calls}",
            f"head[lazy]: TEXT {json.dumps(trigger)}",  # lazy: the head ends at the trigger's first occurrence
            r"TEXT: /(.|\n)*/",
        ]
    schema = {**close(schema), "x-guidance": COMPACT_JSON}
    return "\n".join([*lines, f"call: %json {json.dumps(schema)}"])


def _text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str) and value != ""
