"""POST /v1/chat/completions: `messages` through the chat template in, OpenAI's chat shapes out.

GPT-2 has no chat format: the template (api/chat_template.toml, or CHAT_TEMPLATE) turns the
messages into a transcript and opens the assistant's turn; the reply ends where the model
begins the next turn (the template's stop strings), at end-of-text or at max_tokens.
With `tools`, the template offers them and writes calls as text; a reply's call is constrained by
the grammar engine (forced: the whole reply; "auto": from the template's opener on) and answered
as OpenAI's `tool_calls` (api/tool_calls.py).
"""

import json
import time
import uuid
from typing import Any, NamedTuple

from flask import Blueprint, jsonify, request

from api.chat_protocol import AssistantMessage, ChatBody, Content, JsonSchemaFormat, Message, ToolMessage
from api.chat_template import ChatTemplate
from api.errors import bad
from api.generation import Generation, Server, server, to_generation
from api.protocol import parse
from api.structured import Asked, json_schema
from api.submission import (
    EventStream,
    NewTokens,
    Submitted,
    run,
    streamed_response,
    submit,
    text_token_count,
    token_text,
)
from api.tool_calls import Calls, StreamedReply, call_json, call_schema, new_call_id, split_reply
from batching.inference import Delta, Inference
from generate.constraints import Constraint

routes = Blueprint("chat", __name__)


class ChatRequest(NamedTuple):
    generation: Generation  # its stop strings: the request's and the template's
    logprobs: int | None  # top log-probabilities of each token, when asked
    tool_choice: str  # "none", "auto", "required", or "function": the reply must call `function`
    function: str | None  # the function named by tool_choice
    calls: Calls  # how the reply writes its calls (opener None: the reply is calls, forced)


def parse_chat(raw: Any) -> ChatRequest:
    body = parse(ChatBody, raw, "/v1/chat/completions")
    served = server()
    template = served.chat_template
    choice, function = _tool_choice(body)
    text = render(body.messages, template, body if choice != "none" else None)
    if choice in ("required", "function"):
        text += template.forced_call_prefix
    prompt = served.tokenizer.encode(text, disallowed_special=())
    if body.top_logprobs is not None and not body.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens, param = _max_tokens(body, served, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constraints = _chat_constraints(body, choice, function, template)
    generation = to_generation(
        body, prompt, max_tokens, param, logprobs=logprobs, constraints=constraints, stop=template.stop, served=served
    )
    return ChatRequest(generation, logprobs, choice, function, _calls(body, choice, template))


def _parallel(body: ChatBody, choice: str) -> bool:
    """Whether a reply may make several calls: OpenAI's parallel_tool_calls (default true); a request
    that names the function gets one call of it, as vLLM and OpenAI answer it."""
    return choice in ("auto", "required") and body.parallel_tool_calls is not False


def _calls(body: ChatBody, choice: str, template: ChatTemplate) -> Calls:
    """How the reply writes its calls: after the opener with "auto", from the reply's start when forced;
    parallel calls separated as the transcript separates an assistant turn's calls."""
    separator = template.call_closer + template.call_opener if _parallel(body, choice) else None
    return Calls(template.call_opener if choice == "auto" else None, separator, template.call_closer)


def _tool_choice(body: ChatBody) -> tuple[str, str | None]:
    """ "none", "auto", "required" or "function", and the function's name for "function"."""
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return "none", None
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        return choice, None
    if all(t.function.name != choice.function.name for t in body.tools):
        raise bad(f"'tool_choice' names {choice.function.name!r}, which is not among 'tools'", "tool_choice")
    return "function", choice.function.name


def _chat_constraints(body: ChatBody, choice: str, function: str | None, template: ChatTemplate) -> list[Asked]:
    asked = []
    if isinstance(body.response_format, JsonSchemaFormat):
        schema = body.response_format.json_schema.json_schema
        asked.append(Asked("response_format", json_schema(schema)))
    elif body.response_format is not None and body.response_format.type == "json_object":
        asked.append(Asked("response_format", Constraint("json_object", "")))
    if choice == "none":
        return asked
    assert body.tools is not None
    schema, calls = call_schema(body.tools, function), _calls(body, choice, template)
    if choice == "auto":
        spec = {"trigger": calls.opener, "schema": schema, "separator": calls.separator}
        asked.append(Asked("tools", Constraint("tool_auto", json.dumps(spec))))
    elif calls.separator is not None:
        spec = {"schema": schema, "separator": calls.separator}
        asked.append(Asked("tools", Constraint("tool_calls", json.dumps(spec))))
    else:
        asked.append(Asked("tools", json_schema(schema)))
    return asked


def _max_tokens(body: ChatBody, served: Server, num_prompt_tokens: int) -> tuple[int, str]:
    """max_completion_tokens (OpenAI's current name) or max_tokens, and which; by default, as much as fits."""
    given = [name for name in ("max_completion_tokens", "max_tokens") if getattr(body, name) is not None]
    if len(given) == 2 and body.max_tokens != body.max_completion_tokens:
        raise bad("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    if not given:
        return max(1, served.engine.max_sequence_tokens - num_prompt_tokens), "messages"
    return getattr(body, given[0]), given[0]


def render(messages: list[Message], template: ChatTemplate, offering: ChatBody | None = None) -> str:
    """The prompt: the offered tools (`offering`'s, when it offers them), each message's turn, the reply's opening.
    A tool's result must answer a call an earlier assistant message made."""
    turns, calls = [], set()
    for i, message in enumerate(messages):
        text = "" if message.content is None else _text(message.content)
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls:
                _check_arguments(call.function.arguments, i)
                text += template.call(call_json(call.function.name, call.function.arguments))
                calls.add(call.id)
        if isinstance(message, ToolMessage) and message.tool_call_id not in calls:
            raise bad(f"'messages[{i}].tool_call_id' answers no earlier assistant tool call", "messages")
        turns.append((message.role, text))
    tools = None
    if offering is not None and offering.tools:
        tools = [json.dumps(t.function.model_dump(exclude_none=True, exclude={"strict"})) for t in offering.tools]
    return template.render(turns, tools)


def _text(content: Content) -> str:
    """A string, or text parts joined by newlines (as vLLM joins them)."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _check_arguments(arguments: str, i: int) -> None:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        raise bad(f"'messages[{i}].tool_calls': 'arguments' must be JSON text", "messages") from None


@routes.post("/v1/chat/completions")
def chat_completions():
    chat = parse_chat(request.get_json(silent=True))
    generation, served = chat.generation, chat.generation.server
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": generation.model}
    if generation.stream:
        submitted = submit(generation, streamed=True)
        head["object"] = "chat.completion.chunk"
        content = None if chat.tool_choice in ("required", "function") else ""  # a forced call has no content
        count = len(submitted.completions)
        opening = [_chunk_choice(i, {"role": "assistant", "content": content}) for i in range(count)]
        render_delta = _StreamedReplies(chat, submitted).render
        return streamed_response(
            EventStream(served, submitted, head, render_delta, generation.include_usage, first=opening)
        )
    submitted = run(generation)
    choices = [_choice(served, chat, completion) for completion in submitted.completions]
    if generation.return_token_ids:
        head["prompt_token_ids"] = generation.prompts[0]
        for choice, completion in zip(choices, submitted.completions):
            choice["token_ids"] = completion.generated_ids
    return jsonify(**head, object="chat.completion", choices=choices, usage=submitted.usage)


def _choice(served: Server, chat: ChatRequest, completion: Inference) -> dict:
    logprobs = None
    if chat.logprobs is not None:
        logprobs = {"content": _token_logprobs(served, completion, 0, text_token_count(completion), chat.logprobs)}
    message, finish_reason = {"role": "assistant", "content": completion.text.text}, completion.finish_reason
    if chat.tool_choice != "none" and completion.finish_reason == "stop":
        content, calls = split_reply(completion.text.text, chat.calls)
        if calls:
            tool_calls = [call.as_openai(new_call_id()) for call in calls]
            message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
            finish_reason = _call_finish_reason(chat)
    return {"index": completion.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _call_finish_reason(chat: ChatRequest) -> str:
    """As OpenAI: "tool_calls" when the model chose to call ("auto", "required"), "stop" when the request
    named the function."""
    return "tool_calls" if chat.tool_choice in ("auto", "required") else "stop"


def _chunk_choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class _StreamedReplies:
    """Each delta's chunk: its text as content, and with tools, a call's pieces as tool_calls."""

    def __init__(self, chat: ChatRequest, submitted: Submitted):
        self.chat, self.new_tokens = chat, NewTokens(submitted)
        self.texts = [""] * len(submitted.completions)
        self.token_ids: list[int] = []  # of the delta being rendered (return_token_ids)
        self.replies = [StreamedReply(chat.calls) for _ in submitted.completions]

    def render(self, delta: Delta) -> dict:
        completion, start, end = self.new_tokens.take(delta)
        logprobs = None
        if self.chat.logprobs is not None:
            served = self.chat.generation.server
            logprobs = {"content": _token_logprobs(served, completion, start, end, self.chat.logprobs)}
        if self.chat.generation.return_token_ids:  # this chunk's ids, an ending end-of-text included
            self.token_ids = completion.generated_ids[
                start : completion.seq.num_generated if delta.finish_reason else end
            ]
        if self.chat.tool_choice == "none":
            return self._chunk(delta.index, {"content": delta.text}, logprobs, delta.finish_reason)
        self.texts[delta.index] += delta.text
        reply = self.replies[delta.index]
        piece = reply.delta(self.texts[delta.index], finished=delta.finish_reason is not None)
        finish_reason = delta.finish_reason
        if finish_reason == "stop" and reply.named:
            finish_reason = _call_finish_reason(self.chat)
        return self._chunk(delta.index, piece, logprobs, finish_reason)

    def _chunk(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = _chunk_choice(index, delta, logprobs, finish_reason)
        if self.chat.generation.return_token_ids:
            choice["token_ids"] = self.token_ids
        return choice


def _token_logprobs(served: Server, completion: Inference, start: int, end: int, top_n: int) -> list[dict]:
    """OpenAI's chat `logprobs.content`: each token with its log-probability and the top_n most likely."""

    def entry(token: int, logprob: float) -> dict:
        raw = served.tokenizer.decode_single_token_bytes(token)
        return {"token": token_text(served, token), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top[:top_n]]}
        for token, e in zip(completion.generated_ids[start:end], completion.seq.logprobs[start:end])
    ]
