"""OpenAI-compatible completions: POST /v1/completions (streaming too) and GET /v1/models.

Beyond one prompt in, one completion out: `n` completions of each prompt, a list of prompts,
`echo` (the prompt before the completion, with its tokens' log-probabilities), and OpenAI's
`logprobs` with the sampled token among the top entries.
"""

import time
import uuid
from itertools import accumulate
from typing import Any, NamedTuple

from flask import Blueprint, Response, jsonify, request

from api.generation import NewTokens, Request, sse, start, text_token_count, token_text, usage, wait_all
from api.lora import model_cards
from api.openai_params import SharedFields, check_min_tokens, model_name, shared_fields
from api.protocol import CompletionBody, parse
from api.serving import Server, check_fits, server
from api.structured import compiled, guided, one_constraint
from api.validation import bad
from batching.inference import Delta, Inference
from generate.sequence import SamplingParams, TokenLogprobs
from model.tokenizer import encode_prompt

routes = Blueprint("openai", __name__)


class CompletionRequest(NamedTuple):
    prompts: list[list[int]]
    prompt_texts: list[str]  # what echo returns
    params: SamplingParams
    shared: SharedFields
    echo: bool


def parse_completion(raw: Any, srv: Server) -> CompletionRequest:
    body = parse(CompletionBody, raw, "/v1/completions")
    shared = shared_fields(body, srv)
    if body.best_of is not None and body.best_of != body.n:
        raise bad("'best_of' is not supported: only 'best_of' equal to 'n' (every candidate returned)", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad("'max_tokens' may be 0 only with 'echo': true (the prompt's log-probabilities)", "max_tokens")
    if body.max_tokens > srv.engine.max_context:
        raise bad(f"'max_tokens' must be at most {srv.engine.max_context}, got {body.max_tokens}", "max_tokens")
    check_min_tokens(shared.min_tokens, body.max_tokens)
    prompts, texts = _prompts(body.prompt, srv)
    for i, ids in enumerate(prompts):
        check_fits(srv, len(ids), body.max_tokens, "max_tokens", f"prompt {i}: " if len(prompts) > 1 else "")
    params = SamplingParams(
        max_tokens=body.max_tokens,
        min_tokens=shared.min_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if body.echo else None,
        constraint=compiled(one_constraint(guided(body))),
        **shared.sampling,
    )
    return CompletionRequest(prompts, texts, params, shared, body.echo)


def _prompts(prompt: str | list, srv: Server) -> tuple[list[list[int]], list[str]]:
    """A string, a list of token ids, or a list of either (the shapes CompletionBody allows): the
    prompts' ids, and their text."""
    vocab = srv.tokenizer.n_vocab
    many = isinstance(prompt, list) and not isinstance(prompt[0], int)
    items = prompt if many else [prompt]
    if any(isinstance(p, list) and not all(0 <= t < vocab for t in p) for p in items):
        raise bad(f"'prompt' token ids must be from 0 to {vocab - 1}", "prompt")
    ids = [encode_prompt(srv.tokenizer, p) if isinstance(p, str) else p for p in items]
    texts = [p if isinstance(p, str) else srv.tokenizer.decode(p) for p in items]
    return ids, texts


@routes.get("/v1/models")
def models():
    return jsonify(object="list", data=model_cards())


@routes.post("/v1/completions")
def completions():
    srv = server()
    creq = parse_completion(request.get_json(silent=True), srv)
    shared = creq.shared
    req = start(srv, creq.prompts, creq.params, shared.n, shared.stop, shared.stream, shared.priority, shared.lora)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name(srv, shared.lora),
    }
    if creq.shared.stream:
        render = _StreamedChoices(srv, creq, req).render
        events = sse(srv, req, head, render, creq.shared.include_usage)
        return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    wait_all(srv, req)
    choices = [_choice(srv, creq, req, inf) for inf in req.completions]
    return jsonify(**head, choices=choices, usage=usage(req))


def _choice(srv: Server, creq: CompletionRequest, req: Request, inf: Inference) -> dict:
    prompt = req.prompt_of(inf)
    echo = creq.prompt_texts[prompt] if creq.echo else ""
    logprobs = None
    if creq.params.logprobs is not None:
        rows = _prompt_rows(req.prompts[prompt], inf) if creq.echo else []
        logprobs = _logprobs(srv, rows + _generated_rows(inf, 0, text_token_count(inf)), creq.params.logprobs)
    choice = {
        "index": inf.index,
        "text": echo + inf.text.text,
        "logprobs": logprobs,
        "finish_reason": inf.finish_reason,
    }
    return _with_token_ids(choice, creq, req, inf, 0, len(inf.generated_ids), True)


def _with_token_ids(
    choice: dict, creq: CompletionRequest, req: Request, inf: Inference, start: int, end: int, first: bool
) -> dict:
    """vLLM's return_token_ids: the choice's generated token ids (of this delta when streaming), and its
    prompt's with its first chunk."""
    if creq.shared.return_token_ids:
        choice["prompt_token_ids"] = req.prompts[req.prompt_of(inf)] if first else None
        choice["token_ids"] = inf.generated_ids[start:end]
    return choice


class _StreamedChoices:
    """Renders each delta of a streamed request: the echo with a completion's first delta, and the
    log-probabilities of the tokens generated since its last one."""

    def __init__(self, srv: Server, creq: CompletionRequest, req: Request):
        self.srv, self.creq, self.req = srv, creq, req
        self.new_tokens = NewTokens(req)
        self.chars_sent = [0] * len(req.completions)
        self.started = [False] * len(req.completions)

    def render(self, delta: Delta) -> dict:
        i = delta.index
        inf, start, end = self.new_tokens.take(delta)
        prompt = self.req.prompt_of(inf)
        first = not self.started[i]
        echoing = self.creq.echo and first  # with the completion's first delta
        self.started[i] = True
        echo = self.creq.prompt_texts[prompt] if echoing else ""
        logprobs = None
        if self.creq.params.logprobs is not None:
            rows = _prompt_rows(self.req.prompts[prompt], inf) if echoing else []
            logprobs = _logprobs(
                self.srv, rows + _generated_rows(inf, start, end), self.creq.params.logprobs, self.chars_sent[i]
            )
            self.chars_sent[i] += sum(len(t) for t in logprobs["tokens"])
        choice = {"index": i, "text": echo + delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        end = inf.seq.num_generated if delta.finish_reason else end  # the ids include an ending end-of-text
        return _with_token_ids(choice, self.creq, self.req, inf, start, end, first)


Row = tuple[int, TokenLogprobs | None]  # a token, and its log-probabilities (None: the prompt's first token)


def _prompt_rows(prompt: list[int], inf: Inference) -> list[Row]:
    return [(prompt[0], None), *zip(prompt[1:], inf.seq.prompt_logprobs)]


def _generated_rows(inf: Inference, start: int, end: int) -> list[Row]:
    return list(zip(inf.generated_ids[start:end], inf.seq.logprobs[start:end]))


def _logprobs(srv: Server, rows: list[Row], top_n: int, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: each token, its log-probability, the top_n most likely tokens
    plus the token itself when it is not among them, and where the token starts in the text."""
    tokens = [token_text(srv, t) for t, _ in rows]
    top = [None if e is None else _top(srv, t, e, top_n) for t, e in rows]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for _, e in rows],
        "top_logprobs": top,
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
    }


def _top(srv: Server, token: int, entry: TokenLogprobs, top_n: int) -> dict[str, float]:
    top = {token_text(srv, t): lp for t, lp in entry.top[:top_n]}
    if all(t != token for t, _ in entry.top[:top_n]):
        top[token_text(srv, token)] = entry.logprob
    return top
