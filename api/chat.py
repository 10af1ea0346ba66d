"""POST /v1/chat/completions: `messages` through the chat template in, OpenAI's chat shapes out.

GPT-2 has no chat format: the template (api/chat_template.toml, or CHAT_TEMPLATE) turns the
messages into a transcript and opens the assistant's turn; the reply ends where the model
begins the next turn (the template's stop strings), at end-of-text or at max_tokens.
"""

import time
import uuid
from typing import Any, NamedTuple

from flask import Blueprint, Response, jsonify, request

from api.chat_template import ROLE_ALIASES, ROLES
from api.generation import NewTokens, Request, sse, start, text_token_count, token_text, usage, wait_all
from api.openai_params import SHARED_FIELDS, SharedFields, check_min_tokens, parse_shared
from api.serving import Server, check_fits, server
from api.validation import bad, boolean, integer, json_object, known_fields
from batching.inference import Delta, Inference
from generate.sequence import SamplingParams

routes = Blueprint("chat", __name__)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat completions
FIELDS = SHARED_FIELDS | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}


class ChatRequest(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    shared: SharedFields
    stop: tuple[str, ...]  # the request's and the template's


def parse_chat(body: Any, srv: Server) -> ChatRequest:
    body = json_object(body)
    known_fields(body, FIELDS, "/v1/chat/completions")
    shared = parse_shared(body, srv)
    prompt = srv.tokenizer.encode(srv.chat_template.render(parse_messages(body.get("messages"))), disallowed_special=())
    logprobs = boolean(body, "logprobs", False)
    if "top_logprobs" in body and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    top_logprobs = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    max_tokens, param = _max_tokens(body, srv, len(prompt))
    check_min_tokens(shared.min_tokens, max_tokens)
    check_fits(srv, len(prompt), max_tokens, param)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=shared.min_tokens,
        logprobs=top_logprobs if logprobs else None,
        **shared.sampling,
    )
    return ChatRequest(prompt, params, shared, shared.stop + srv.chat_template.stop)


def _max_tokens(body: dict, srv: Server, num_prompt_tokens: int) -> tuple[int, str]:
    """max_completion_tokens (OpenAI's current name) or max_tokens; by default, as much as fits."""
    given = [name for name in ("max_completion_tokens", "max_tokens") if name in body]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise bad("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    if not given:
        return max(1, srv.engine.max_sequence_tokens - num_prompt_tokens), "messages"
    return integer(body, given[0], None, 1, srv.engine.max_context), given[0]


def parse_messages(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, i: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise bad(f"'messages[{i}]' must be an object with 'role' and 'content'", "messages")
    message = json_object(message)
    for name in message:
        if name not in ("role", "content"):
            raise bad(f"'messages[{i}].{name}' is not supported (messages have a role and text content)", "messages")
    role = message.get("role")
    if role not in ROLES and role not in ROLE_ALIASES:
        names = ", ".join((*ROLES, *ROLE_ALIASES))
        raise bad(f"'messages[{i}].role' must be one of {names} (tools are not supported), got {role!r}", "messages")
    return role, _content(message.get("content"), i)


def _content(content: Any, i: int) -> str:
    """A string, or a list of text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts and all(_is_text_part(p) for p in parts):
        return "\n".join(p["text"] for p in parts)
    raise bad(f"'messages[{i}].content' must be a string or a list of text parts", "messages")


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and set(part) == {"type", "text"}
        and part["type"] == "text"
        and isinstance(part["text"], str)
    )


@routes.post("/v1/chat/completions")
def chat_completions():
    srv = server()
    chat = parse_chat(request.get_json(silent=True), srv)
    req = start(srv, [chat.prompt], chat.params, chat.shared.n, chat.stop, chat.shared.stream, chat.shared.priority)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": srv.engine.model_name}
    if chat.shared.stream:
        head["object"] = "chat.completion.chunk"
        opening = [_chunk_choice(i, {"role": "assistant", "content": ""}) for i in range(len(req.completions))]
        render = _StreamedReplies(srv, chat, req).render
        events = sse(srv, req, head, render, chat.shared.include_usage, first=opening)
        return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    wait_all(srv, req)
    choices = [_choice(srv, chat, inf) for inf in req.completions]
    return jsonify(**head, object="chat.completion", choices=choices, usage=usage(req))


def _choice(srv: Server, chat: ChatRequest, inf: Inference) -> dict:
    logprobs = None
    if chat.params.logprobs is not None:
        logprobs = {"content": _token_logprobs(srv, inf, 0, text_token_count(inf), chat.params.logprobs)}
    return {
        "index": inf.index,
        "message": {"role": "assistant", "content": inf.text.text},
        "logprobs": logprobs,
        "finish_reason": inf.finish_reason,
    }


def _chunk_choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class _StreamedReplies:
    def __init__(self, srv: Server, chat: ChatRequest, req: Request):
        self.srv, self.chat, self.new_tokens = srv, chat, NewTokens(req)

    def render(self, delta: Delta) -> dict:
        inf, start, end = self.new_tokens.take(delta)
        logprobs = None
        if self.chat.params.logprobs is not None:
            logprobs = {"content": _token_logprobs(self.srv, inf, start, end, self.chat.params.logprobs)}
        return _chunk_choice(delta.index, {"content": delta.text}, logprobs, delta.finish_reason)


def _token_logprobs(srv: Server, inf: Inference, start: int, end: int, top_n: int) -> list[dict]:
    """OpenAI's chat `logprobs.content`: each token with its log-probability and the top_n most likely."""

    def entry(token: int, logprob: float) -> dict:
        raw = srv.tokenizer.decode_single_token_bytes(token)
        return {"token": token_text(srv, token), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top[:top_n]]}
        for token, e in zip(inf.generated_ids[start:end], inf.seq.logprobs[start:end])
    ]
