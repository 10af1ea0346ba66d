"""Tool calls as text: the JSON a call is written as, its schema, and reading it back (whole or streamed).

A call is written {"name": <function>, "arguments": <the function's arguments>} (the chat
template wraps it in its opener and closer). With the name first, a streamed reply can announce
the call as soon as its name is complete and then pass the arguments on piece by piece, as
OpenAI streams `delta.tool_calls`.
"""

import json
import re
import uuid
from dataclasses import dataclass

from api.protocol import Tool

# The call up to its arguments: the grammar writes the name first (the schema's property order).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def call_schema(tools: list[Tool], name: str | None = None) -> dict:
    """The JSON Schema of one call: of the function `name`, or of any of `tools`, each name tied to
    its own arguments."""
    chosen = [t.function for t in tools if name is None or t.function.name == name]
    assert chosen, name
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_json(name: str, arguments: str) -> str:
    """A call as the transcript writes it (an assistant message's earlier call, or the model's own)."""
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as the model wrote it

    def as_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(text: str) -> Call | None:
    """The call `text` holds (after the template's opener, up to its end), or None if it holds no whole one."""
    head = _HEAD.match(text)
    if head is None:
        return None
    arguments = _arguments_so_far(text[head.end() :], finished=True)
    try:
        whole = json.loads(text[: head.end()] + arguments + "}")
    except json.JSONDecodeError:
        return None
    if not isinstance(whole, dict) or not isinstance(whole.get("name"), str):
        return None
    return Call(whole["name"], arguments)


def _arguments_so_far(rest: str, finished: bool) -> str:
    """The arguments' text in `rest` (what follows "arguments":): finished, all but the call's closing
    brace and what surrounds it; unfinished, all but a trailing run of braces and whitespace, any of
    which may yet turn out to close the call."""
    if finished:
        return rest.rstrip().removesuffix("}").rstrip()
    return rest.rstrip("} \t\r\n")


class StreamedCall:
    """Turns a forced call's growing text into OpenAI's streamed `delta.tool_calls` pieces: the first
    with the id and the name (once the name is whole), then the arguments as they come."""

    def __init__(self):
        self.call_id = new_call_id()
        self.named = False
        self.sent = 0  # characters of the arguments passed on

    def pieces(self, text: str, finished: bool) -> list[dict]:
        """What `text` (the call so far) adds to what was passed on; the whole call once `finished`."""
        head = _HEAD.match(text)
        if head is None:
            return []
        out = []
        if not self.named:
            self.named = True
            name = json.loads(head.group(1))
            out.append({"index": 0, "id": self.call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        arguments = _arguments_so_far(text[head.end() :], finished)
        if len(arguments) > self.sent:
            out.append({"index": 0, "function": {"arguments": arguments[self.sent :]}})
            self.sent = len(arguments)
        return out
