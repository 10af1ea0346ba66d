"""One OpenAI request's completions: start them (n per prompt, forks sharing the prompt), wait or stream.

A request's completions are ordered by prompt, then by n, and `index` is that order. They enter
the batcher together; each is an Inference of its own, with its own text, stop strings and
random stream. With a seed, completion j of a prompt uses seed + j, so each is reproducible
and they differ from each other (and completion 0 is what n = 1 would give).
"""

import json
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from api import tenants
from api.serving import Server, submit
from api.validation import ApiError
from batching.inference import Delta, Inference
from batching.text_stream import TextStream
from generate.sequence import SamplingParams
from model.lora import LoraAdapter
from model.tokenizer import EOT_ID

SEED_LIMIT = 2**63


@dataclass(frozen=True, slots=True)
class Request:
    prompts: list[list[int]]
    completions: list[Inference]  # by index
    n: int

    def prompt_of(self, inf: Inference) -> int:
        return inf.index // self.n


def start(
    srv: Server,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    stop: tuple[str, ...],
    stream: bool,
    priority: int = 0,
    lora: LoraAdapter | None = None,
) -> Request:
    """Submit n completions of every prompt, for the request's tenant; the first of each prompt leads, the
    others fork from it."""
    tenant = tenants.current()
    chunks = queue.SimpleQueue() if stream else None
    completions = []
    for prompt in prompts:
        leader = None
        for j in range(n):
            own = params if params.seed is None else replace(params, seed=(params.seed + j) % SEED_LIMIT)
            text = TextStream(srv.tokenizer, stop)
            index = len(completions)
            inf = Inference(
                prompt,
                own,
                text=text,
                chunks=chunks,
                index=index,
                fork_of=leader,
                priority=priority,
                tenant=tenant,
                lora=lora,
            )
            leader = leader or inf
            completions.append(inf)
    submit(srv, *completions)
    return Request(prompts, completions, n)


def wait_all(srv: Server, req: Request) -> None:
    """Every completion answered; past REQUEST_TIMEOUT_S they are aborted (blocks freed) and 504 answered."""
    deadline = time.monotonic() + srv.settings.request_timeout_s
    for inf in req.completions:
        if not inf.done.wait(max(0.0, deadline - time.monotonic())):
            srv.manager.cancel(*req.completions)
            break
    for inf in req.completions:
        inf.done.wait()
    _raise_error(srv, req.completions)


def _raise_error(srv: Server, completions: Iterable[Inference]) -> None:
    errors = [inf.error for inf in completions if inf.error]
    if "cancelled" in errors:
        raise ApiError(504, f"no answer within {srv.settings.request_timeout_s} s", "timeout")
    if errors:
        raise ApiError(500, errors[0], "server_error")


def deltas(srv: Server, req: Request) -> Iterator[Delta]:
    """Every completion's deltas as they come (interleaved, each in order), until all are answered."""
    deadline = time.monotonic() + srv.settings.request_timeout_s
    chunks = req.completions[0].chunks
    pending = len(req.completions)
    while pending:
        try:
            chunk = chunks.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise ApiError(504, f"no answer within {srv.settings.request_timeout_s} s", "timeout") from None
        if isinstance(chunk, Delta):
            yield chunk
            continue
        pending -= 1
        _raise_error(srv, [chunk])


def sse(
    srv: Server,
    req: Request,
    head: dict,
    render: Callable[[Delta], dict],
    include_usage: bool,
    first: Iterable[dict] = (),
) -> Iterator[str]:
    """Server-sent events: `first` choices, one event per delta, the usage if asked, then [DONE].
    A client that hangs up closes this generator, which cancels the request."""
    try:
        for choice in first:
            yield event({**head, "choices": [choice]})
        for delta in deltas(srv, req):
            yield event({**head, "choices": [render(delta)]})
        if include_usage:
            yield event({**head, "choices": [], "usage": usage(req)})
    except ApiError as err:
        yield event(err.body())
    finally:
        unanswered = [inf for inf in req.completions if not inf.done.is_set()]
        if unanswered:
            srv.manager.cancel(*unanswered)
    yield "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(req: Request) -> dict:
    """The prompts count once each, whatever n; every completion's tokens count."""
    prompt = sum(len(p) for p in req.prompts)
    generated = sum(len(inf.generated_ids) for inf in req.completions)
    leaders = req.completions[:: req.n]
    cached = sum(inf.seq.num_cached_prompt_tokens or 0 for inf in leaders)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def text_token_count(inf: Inference, upto: int | None = None) -> int:
    """Generated tokens that make text: all but an ending end-of-text token (which is no text)."""
    count = inf.seq.num_generated if upto is None else upto
    ids = inf.generated_ids
    ended_by_eos = inf.finish_reason == "stop" and inf.params.stop_at_eos and ids and ids[-1] == EOT_ID
    return count - 1 if ended_by_eos and count == len(ids) else count


class NewTokens:
    """Which generated tokens each streamed delta brings, for their log-probabilities."""

    def __init__(self, req: Request):
        self.req = req
        self._sent = [0] * len(req.completions)

    def take(self, delta: Delta) -> tuple[Inference, int, int]:
        """The delta's completion, and the range of its tokens not reported before."""
        inf = self.req.completions[delta.index]
        end = text_token_count(inf, delta.num_tokens) if delta.finish_reason else delta.num_tokens
        start, self._sent[delta.index] = self._sent[delta.index], end
        return inf, start, end


def token_text(srv: Server, token: int) -> str:
    return srv.tokenizer.decode_single_token_bytes(token).decode("utf-8", errors="replace")
