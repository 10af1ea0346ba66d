"""OpenAI-compatible completions: POST /v1/completions (streaming too) and GET /v1/models."""

import json
import queue
import time
import uuid
from collections.abc import Iterator
from itertools import accumulate
from typing import Any, NamedTuple

from flask import Blueprint, Response, jsonify, request

from api.serving import Server, check_fits, server, submit, wait
from api.validation import ApiError, bad, boolean, integer, json_object, number, optional_seed
from batching.inference import Inference
from batching.text_stream import TextStream
from generate.sequence import SamplingParams

routes = Blueprint("openai", __name__)
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 5


class CompletionRequest(NamedTuple):
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # streaming: a last event with the token counts, as OpenAI's stream_options has it


def parse_completion(body: Any, srv: Server) -> CompletionRequest:
    body = json_object(body)
    model = body.get("model")
    if model is not None and model != srv.engine.model_name:
        raise bad(f"'model' must be {srv.engine.model_name!r} (the served model) or omitted, got {model!r}", "model")
    if body.get("n", 1) != 1:
        raise bad(f"'n' must be 1: one completion per request, got {body.get('n')!r}", "n")
    logprobs = None if body.get("logprobs") is None else integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    stream = boolean(body, "stream", False)
    if stream and logprobs is not None:
        raise bad("'logprobs' is available without streaming only", "logprobs")
    return CompletionRequest(
        prompt_ids=_prompt_ids(body.get("prompt"), srv),
        params=SamplingParams(
            max_tokens=integer(body, "max_tokens", 16, 1, srv.engine.max_context),
            temperature=number(body, "temperature", 1.0, 0.0, 2.0),
            top_k=integer(body, "top_k", 0, 0, 50257),
            top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
            seed=optional_seed(body),
            stop_at_eos=not boolean(body, "ignore_eos", False),
            logprobs=logprobs,
        ),
        stop=_stop_strings(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
    )


def _prompt_ids(prompt: Any, srv: Server) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return srv.tokenizer.encode(prompt, disallowed_special=())
    vocab = srv.tokenizer.n_vocab
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab for t in prompt):
        return prompt
    raise bad(f"'prompt' must be a non-empty string or a list of token ids below {vocab}", "prompt")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
        raise bad("'stream_options' must be an object with at most the key 'include_usage'", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options")
    return options.get("include_usage", False)


@routes.get("/v1/models")
def models():
    name = server().engine.model_name
    return jsonify(object="list", data=[{"id": name, "object": "model", "created": 0, "owned_by": "local"}])


@routes.post("/v1/completions")
def completions():
    srv = server()
    req = parse_completion(request.get_json(silent=True), srv)
    check_fits(srv, len(req.prompt_ids), req.params.max_tokens, "max_tokens")
    inf = Inference(
        req.prompt_ids,
        req.params,
        text=TextStream(srv.tokenizer, req.stop),
        chunks=queue.SimpleQueue() if req.stream else None,
    )
    submit(srv, inf)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": srv.engine.model_name,
    }
    if req.stream:
        events = _events(srv, inf, head, req.include_usage)
        return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    wait(srv, inf)
    return jsonify(**head, choices=[_choice(inf.text.text, inf.finish_reason, _logprobs(srv, inf))], usage=_usage(inf))


def _usage(inf: Inference) -> dict:
    n_prompt, n_done = len(inf.prompt_ids), len(inf.generated_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_done, "total_tokens": n_prompt + n_done}


def _choice(text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def _logprobs(srv: Server, inf: Inference) -> dict | None:
    """The OpenAI completions `logprobs` object, for the tokens that made the text."""
    top_n = inf.params.logprobs
    if top_n is None:
        return None
    ids, entries = inf.generated_ids, inf.seq.logprobs
    if inf.seq.finish_reason == "stop":  # the end-of-text token is no text
        ids, entries = ids[:-1], entries[:-1]
    piece = lambda t: srv.tokenizer.decode_single_token_bytes(t).decode("utf-8", errors="replace")
    tokens = [piece(t) for t in ids]
    offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries] if top_n else None,
        "text_offset": offsets,
    }


def _events(srv: Server, inf: Inference, head: dict, include_usage: bool) -> Iterator[str]:
    """Server-sent events; a client that hangs up closes this generator, which cancels the request."""
    deadline = time.monotonic() + srv.settings.request_timeout_s
    try:
        while True:
            try:
                piece = inf.chunks.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ApiError(504, f"no answer within {srv.settings.request_timeout_s} s", "timeout") from None
            if piece is None:
                break
            yield _event({**head, "choices": [_choice(piece, None)]})
        if inf.error:
            raise ApiError(500, inf.error, "server_error")
        yield _event({**head, "choices": [_choice("", inf.finish_reason)]})
        if include_usage:
            yield _event({**head, "choices": [], "usage": _usage(inf)})
    except ApiError as err:
        yield _event(err.body())
    finally:
        if not inf.done.is_set():
            srv.manager.cancel(inf)
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
