"""Tool calls as text: the JSON a call is written as, its schema, and reading it back (whole or streamed).

A call is written {"name": <function>, "arguments": <the function's arguments>} (the chat
template wraps it in its opener and closer). With the name first, a streamed reply can announce
the call as soon as its name is complete and then pass the arguments on piece by piece, as
OpenAI streams `delta.tool_calls`. Parallel calls follow each other as the transcript writes an
assistant turn's calls: the separator between two is the template's closer then its opener.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from api.chat_protocol import Tool

# The call up to its arguments: the grammar writes the name first (the schema's property order).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def call_schema(tools: list[Tool], name: str | None = None) -> dict:
    """The JSON Schema of one call: of the function `name`, or of any of `tools`, each name tied to
    its own arguments. Each function's `$defs` move to the call schema's root, under the function's
    name (its `$ref`s follow), since the parameters are no longer the root their refs point into."""
    chosen = [t.function for t in tools if name is None or t.function.name == name]
    assert chosen, name
    options, defs = [], {}
    for f in chosen:
        parameters, own = _hoisted(f.name, f.parameters)
        defs.update(own)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


_DEFS = ("$defs", "definitions")


def _hoisted(name: str, parameters: dict) -> tuple[dict, dict]:
    """The parameters without their definitions, and the definitions renamed `name.key`, every
    `#/$defs/key` (or `#/definitions/key`) ref in both rewritten to match."""
    defs = {f"{name}.{key}": d for where in _DEFS for key, d in (parameters.get(where) or {}).items()}
    rest = {k: v for k, v in parameters.items() if k not in _DEFS}
    return _renamed_refs(rest, name), {key: _renamed_refs(d, name) for key, d in defs.items()}


def _renamed_refs(schema: Any, name: str) -> Any:
    if isinstance(schema, list):
        return [_renamed_refs(s, name) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _renamed_refs(v, name) for k, v in schema.items()}
    ref = out.get("$ref")
    for where in _DEFS:
        if isinstance(ref, str) and ref.startswith(f"#/{where}/"):
            out["$ref"] = f"#/$defs/{name}.{ref.removeprefix(f'#/{where}/')}"
    return out


def call_json(name: str, arguments: str) -> str:
    """A call as the transcript writes it (an assistant message's earlier call, or the model's own)."""
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as the model wrote it

    def as_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Written(NamedTuple):
    """A call as far as the text has written it."""

    name: str
    arguments: str  # so far (whole: all of them)
    end: int | None  # where the whole call ends in the text; None while it is not whole


def _calls_so_far(text: str, separator: str | None, finished: bool) -> list[_Written]:
    """The calls `text` writes from its start, `separator` between two (None: one call at most); the
    last may be unfinished (`finished`: the text will not grow, as for `_arguments_so_far`)."""
    calls: list[_Written] = []
    pos = 0
    while (head := _HEAD.match(text, pos)) is not None:
        name = json.loads(head.group(1))
        try:
            whole, end = _DECODER.raw_decode(text, text.index("{", pos))
        except json.JSONDecodeError:
            return [*calls, _Written(name, _arguments_so_far(text[head.end() :], finished), None)]
        if not isinstance(whole, dict) or whole.get("name") != name or "arguments" not in whole:
            return calls  # not a call: grammar-held text never gets here
        calls.append(_Written(name, text[head.end() : end - 1].rstrip(), end))
        if separator is None or not text.startswith(separator, end):
            return calls
        pos = end + len(separator)
    return calls


def read_calls(text: str, separator: str | None = None, closer: str = "") -> list[Call]:
    """The calls `text` holds (after the template's opener), all whole and nothing after the last
    but whitespace or the closer; else none: a call cut short is no call."""
    calls = _calls_so_far(text, separator, finished=True)
    if not calls or calls[-1].end is None or text[calls[-1].end :].strip() not in ("", closer.strip()):
        return []
    return [Call(c.name, c.arguments) for c in calls]


def _arguments_so_far(rest: str, finished: bool) -> str:
    """The arguments' text in `rest` (what follows "arguments":): finished, all but the call's closing
    brace and what surrounds it; unfinished, all but a trailing run of braces and whitespace, any of
    which may yet turn out to close the call."""
    if finished:
        return rest.rstrip().removesuffix("}").rstrip()
    return rest.rstrip("} \t\r\n")


class Calls(NamedTuple):
    """How a reply writes its calls: the opener that starts them (None: the reply starts with a call, a
    forced one), the separator between two (None: one call at most), the closer after the last."""

    opener: str | None
    separator: str | None = None
    closer: str = ""


def split_reply(text: str, calls: Calls) -> tuple[str | None, list[Call]]:
    """A reply's content and its calls. With an opener, the calls, if any, follow it (tool_choice
    "auto"). A call cut short (max_tokens, a stop string) is no call: the reply is then its text,
    with no call at all."""
    head, found, rest = text.partition(calls.opener) if calls.opener is not None else ("", True, text)
    read = read_calls(rest, calls.separator, calls.closer) if found else []
    return (head or None, read) if read else (text, [])


class StreamedReply:
    """Turns a reply's growing text into OpenAI's streamed deltas: its content as it comes, and its
    calls as `delta.tool_calls` pieces, each with its `index`: the id and the name once the name is
    whole, then the arguments as they come."""

    def __init__(self, calls: Calls):
        self.calls = calls
        self.ids: list[str] = []  # the announced calls' ids
        self.content_sent = 0  # characters of content passed on
        self.arguments_sent: list[int] = []  # characters of each call's arguments passed on

    @property
    def named(self) -> bool:
        """Whether a call was announced."""
        return bool(self.ids)

    def delta(self, text: str, finished: bool) -> dict:
        """What `text` (the reply so far) adds to what was passed on: {"content": ...}, {"tool_calls": [...]}, or {}."""
        opener = self.calls.opener
        if opener is None:
            return self._calls(text, finished)
        head, found, rest = text.partition(opener)
        # hold back what may be the opener's beginning, unless the reply is over
        held = 0 if found or finished else _partial_suffix(head, opener)
        content = head[self.content_sent : len(head) - held]
        self.content_sent += len(content)
        out = {"content": content} if content else {}
        return {**out, **self._calls(rest, finished)} if found else out

    def _calls(self, text: str, finished: bool) -> dict:
        pieces = []
        for i, call in enumerate(_calls_so_far(text, self.calls.separator, finished)):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append(0)
                function = {"name": call.name, "arguments": ""}
                pieces.append({"index": i, "id": self.ids[i], "type": "function", "function": function})
            if len(call.arguments) > self.arguments_sent[i]:
                pieces.append({"index": i, "function": {"arguments": call.arguments[self.arguments_sent[i] :]}})
                self.arguments_sent[i] = len(call.arguments)
        return {"tool_calls": pieces} if pieces else {}


def _partial_suffix(text: str, opener: str) -> int:
    """The length of the longest end of `text` that begins `opener`."""
    return next((n for n in range(min(len(text), len(opener) - 1), 0, -1) if opener.startswith(text[-n:])), 0)
