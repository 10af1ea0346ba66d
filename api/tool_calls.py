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


def split_reply(text: str, opener: str | None) -> tuple[str | None, Call | None]:
    """A reply's content and its call. `opener` None: the whole reply is a call (a forced one);
    else the call, if any, follows the opener (tool_choice "auto"). A call cut short (max_tokens, a
    stop string) is no call: the reply is its text."""
    if opener is None:
        call = read_call(text)
        return (None, call) if call else (text, None)
    head, found, rest = text.partition(opener)
    call = read_call(rest) if found else None
    return (head or None, call) if call else (text, None)


class StreamedReply:
    """Turns a reply's growing text into OpenAI's streamed deltas: its content as it comes, and its
    call as `delta.tool_calls` pieces: the id and the name once the name is whole, then the
    arguments as they come. `opener` as for `split_reply`."""

    def __init__(self, opener: str | None):
        self.opener = opener
        self.call_id = new_call_id()
        self.named = False  # the call was announced
        self.content_sent = 0  # characters of content passed on
        self.arguments_sent = 0  # characters of the arguments passed on

    def delta(self, text: str, finished: bool) -> dict:
        """What `text` (the reply so far) adds to what was passed on: {"content": ...}, {"tool_calls": [...]}, or {}."""
        if self.opener is None:
            return self._call(text, finished)
        head, found, rest = text.partition(self.opener)
        # hold back what may be the opener's beginning, unless the reply is over
        held = 0 if found or finished else _partial_suffix(head, self.opener)
        content = head[self.content_sent : len(head) - held]
        self.content_sent += len(content)
        out = {"content": content} if content else {}
        return {**out, **self._call(rest, finished)} if found else out

    def _call(self, text: str, finished: bool) -> dict:
        head = _HEAD.match(text)
        if head is None:
            return {}
        pieces = []
        if not self.named:
            self.named = True
            name = json.loads(head.group(1))
            function = {"name": name, "arguments": ""}
            pieces.append({"index": 0, "id": self.call_id, "type": "function", "function": function})
        arguments = _arguments_so_far(text[head.end() :], finished)
        if len(arguments) > self.arguments_sent:
            pieces.append({"index": 0, "function": {"arguments": arguments[self.arguments_sent :]}})
            self.arguments_sent = len(arguments)
        return {"tool_calls": pieces} if pieces else {}


def _partial_suffix(text: str, opener: str) -> int:
    """The length of the longest end of `text` that begins `opener`."""
    return next((n for n in range(min(len(text), len(opener) - 1), 0, -1) if opener.startswith(text[-n:])), 0)
