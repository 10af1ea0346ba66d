"""OpenAI-compatible completions: POST /v1/completions (streaming too) and GET /v1/models.

Beyond one prompt in, one completion out: `n` completions of each prompt, a list of prompts,
`echo` (the prompt before the completion, with its tokens' log-probabilities), and OpenAI's
`logprobs` with the sampled token among the top entries.
"""

import time
import uuid
from itertools import accumulate

from flask import Blueprint, jsonify, request

from api.errors import bad
from api.generation import Generation, Server, to_generation
from api.lora import model_cards
from api.protocol import CompletionBody, parse
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
from batching.inference import Delta, Inference
from generate.sequence import TokenLogprobs

routes = Blueprint("openai", __name__)


@routes.get("/v1/models")
def models():
    return jsonify(object="list", data=model_cards())


@routes.post("/v1/completions")
def completions():
    body = parse(CompletionBody, request.get_json(silent=True), "/v1/completions")
    if body.best_of is not None and body.best_of != body.n:
        raise bad("'best_of' is not supported: only 'best_of' equal to 'n' (every candidate returned)", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad("'max_tokens' may be 0 only with 'echo': true (the prompt's log-probabilities)", "max_tokens")
    generation = to_generation(
        body, body.prompt, body.max_tokens, "max_tokens", logprobs=body.logprobs, prompt_logprobs=body.echo
    )
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": generation.model,
    }
    answer = _Answer(body, generation)
    if generation.stream:
        submitted = submit(generation, streamed=True)
        render = _StreamedChoices(answer, submitted).render
        return streamed_response(EventStream(generation.server, submitted, head, render, generation.include_usage))
    submitted = run(generation)
    choices = [answer.choice(submitted, completion) for completion in submitted.completions]
    return jsonify(**head, choices=choices, usage=submitted.usage)


class _Answer:
    """What a choice is made of: the echoed prompts' texts, the log-probabilities asked for, the token ids."""

    def __init__(self, body: CompletionBody, generation: Generation):
        self.generation, self.echo, self.top_n = generation, body.echo, body.logprobs
        tokenizer = generation.server.tokenizer
        many = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        items = body.prompt if many else [body.prompt]
        self.prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in items] if body.echo else []

    def choice(self, submitted: Submitted, completion: Inference) -> dict:
        prompt = completion.index // submitted.n
        echo = self.prompt_texts[prompt] if self.echo else ""
        logprobs = None
        if self.top_n is not None:
            rows = _prompt_rows(submitted.prompts[prompt], completion) if self.echo else []
            rows += _generated_rows(completion, 0, text_token_count(completion))
            logprobs = _logprobs(self.generation, rows, self.top_n)
        choice = {
            "index": completion.index,
            "text": echo + completion.text.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
        }
        return self.with_token_ids(choice, submitted, completion, 0, len(completion.generated_ids), True)

    def with_token_ids(
        self, choice: dict, submitted: Submitted, completion: Inference, start: int, end: int, first: bool
    ) -> dict:
        """vLLM's return_token_ids: the choice's generated token ids (of this delta when streaming), and its
        prompt's with its first chunk."""
        if self.generation.return_token_ids:
            choice["prompt_token_ids"] = submitted.prompts[completion.index // submitted.n] if first else None
            choice["token_ids"] = completion.generated_ids[start:end]
        return choice


class _StreamedChoices:
    """Renders each delta of a streamed request: the echo with a completion's first delta, and the
    log-probabilities of the tokens generated since its last one."""

    def __init__(self, answer: _Answer, submitted: Submitted):
        self.answer, self.submitted = answer, submitted
        self.new_tokens = NewTokens(submitted)
        self.chars_sent = [0] * len(submitted.completions)
        self.started = [False] * len(submitted.completions)

    def render(self, delta: Delta) -> dict:
        i, answer = delta.index, self.answer
        completion, start, end = self.new_tokens.take(delta)
        prompt = completion.index // self.submitted.n
        first = not self.started[i]
        echoing = answer.echo and first  # with the completion's first delta
        self.started[i] = True
        echo = answer.prompt_texts[prompt] if echoing else ""
        logprobs = None
        if answer.top_n is not None:
            rows = _prompt_rows(self.submitted.prompts[prompt], completion) if echoing else []
            rows += _generated_rows(completion, start, end)
            logprobs = _logprobs(answer.generation, rows, answer.top_n, self.chars_sent[i])
            self.chars_sent[i] += sum(len(t) for t in logprobs["tokens"])
        choice = {"index": i, "text": echo + delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        end = completion.seq.num_generated if delta.finish_reason else end  # the ids include an ending end-of-text
        return answer.with_token_ids(choice, self.submitted, completion, start, end, first)


Row = tuple[int, TokenLogprobs | None]  # a token, and its log-probabilities (None: the prompt's first token)


def _prompt_rows(prompt: list[int], completion: Inference) -> list[Row]:
    return [(prompt[0], None), *zip(prompt[1:], completion.seq.prompt_logprobs)]


def _generated_rows(completion: Inference, start: int, end: int) -> list[Row]:
    return list(zip(completion.generated_ids[start:end], completion.seq.logprobs[start:end]))


def _logprobs(generation: Generation, rows: list[Row], top_n: int, offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: each token, its log-probability, the top_n most likely tokens
    plus the token itself when it is not among them, and where the token starts in the text."""
    server = generation.server
    tokens = [token_text(server, t) for t, _ in rows]
    top = [None if e is None else _top(server, t, e, top_n) for t, e in rows]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for _, e in rows],
        "top_logprobs": top,
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
    }


def _top(server: Server, token: int, entry: TokenLogprobs, top_n: int) -> dict[str, float]:
    top = {token_text(server, t): lp for t, lp in entry.top[:top_n]}
    if all(t != token for t, _ in entry.top[:top_n]):
        top[token_text(server, token)] = entry.logprob
    return top
