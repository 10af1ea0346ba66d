"""From a parsed body (api/protocol.py) to what the engine takes, for every generation endpoint, in one function.

`to_generation` is the one place a request's sampling parameters are made: /inference, /v1/completions and
/v1/chat/completions each hand it their body, their prompt and their max tokens. It checks what depends
on the served model (`model`, `top_k` and `logit_bias` against the vocabulary, `min_tokens` and
`max_tokens` against the context, each prompt against the context and the KV cache), tokenizes the
prompts, names the tenant (and holds `priority` to what its key allows) and compiles a constraint when
one is asked for. The served model is `Server`.
"""

from dataclasses import dataclass
from typing import NamedTuple

import tiktoken
from flask import current_app

from api import structured, tenants
from api.chat_template import ChatTemplate
from api.errors import ApiError, bad
from api.protocol import InferenceBody, Sampling, SamplingRequest
from api.structured import CONSTRAINT_FIELDS, Asked
from batching.manager import BatchingManager
from config import Settings
from generate.engine import Engine
from generate.sequence import SamplingParams
from model.lora import LoraAdapter
from model.tokenizer import encode_prompt

Prompt = str | list[int] | list[str | list[int]]  # text, token ids, or a list of either (completions)
NO_EXTRAS = SamplingRequest()  # /inference takes none of the OpenAI endpoints' extras: their defaults


@dataclass(frozen=True, slots=True)
class Server:
    """What this process serves: its settings, engine, batching manager, tokenizer and chat template."""

    settings: Settings
    engine: Engine
    manager: BatchingManager
    tokenizer: tiktoken.Encoding
    chat_template: ChatTemplate


def server() -> Server:
    return current_app.extensions["server"]


class Generation(NamedTuple):
    """One request as the engine takes it: n completions of each prompt, and what the answer needs."""

    server: Server
    prompts: list[list[int]]
    params: SamplingParams  # every completion's (completion j of a prompt draws with seed + j)
    n: int
    stop: tuple[str, ...]
    priority: int
    tenant: str
    lora: LoraAdapter | None  # the adapter the request's "model" names; None: the base model
    model: str  # the "model" of the response: the adapter's name, or the base model's
    stream: bool
    include_usage: bool  # streaming: a last event with the token counts
    stream_interval: int  # streaming: tokens per event after the first (the server's STREAM_INTERVAL or more)
    return_token_ids: bool  # vLLM's: token ids beside the text (prompt_token_ids, token_ids)


def to_generation(
    body: Sampling,
    prompt: Prompt,
    max_tokens: int,
    max_tokens_field: str,
    *,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    constraints: list[Asked] | None = None,
    stop: tuple[str, ...] = (),
    served: Server | None = None,
) -> Generation:
    """The body's request for the engine. `constraints`: the endpoint's own (chat's response_format and
    tools), beside the body's guided_* fields; `stop`: the endpoint's stop strings, after the body's."""
    served = served or server()
    engine, vocab = served.engine, served.tokenizer.n_vocab
    lora = check_model(body.model, served)
    tenant = tenants.tenant_of(body.user, body.priority)
    extras = body if isinstance(body, SamplingRequest) else NO_EXTRAS
    if body.top_k > vocab:
        raise bad(f"'top_k' must be between -1 and {vocab}, got {body.top_k}", "top_k")
    _check_lengths(extras, max_tokens, max_tokens_field, engine.max_context)
    prompts = _prompts(prompt, served.tokenizer)
    for i, ids in enumerate(prompts):
        problem = engine.check_fits(len(ids), max_tokens)
        if problem:
            raise ApiError(400, (f"prompt {i}: " if len(prompts) > 1 else "") + problem, param=max_tokens_field)
    asks = constraints or body.model_fields_set & CONSTRAINT_FIELDS
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=extras.min_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop_at_eos=body.stop_at_eos if isinstance(body, InferenceBody) else not extras.ignore_eos,
        presence_penalty=extras.presence_penalty,
        frequency_penalty=extras.frequency_penalty,
        repetition_penalty=extras.repetition_penalty,
        logit_bias=_logit_bias(extras.logit_bias, vocab),
        logprobs=logprobs,
        prompt_logprobs=logprobs if prompt_logprobs else None,
        constraint=structured.constraint(extras, constraints or [], engine.constraints.compile) if asks else None,
    )
    request_stop = (extras.stop,) if isinstance(extras.stop, str) else tuple(extras.stop or ())
    include_usage = extras.stream_options is not None and extras.stream_options.include_usage
    model = engine.model_name if lora is None else lora.name
    stream_interval = max(extras.stream_interval or 1, served.settings.stream_interval)
    return Generation(
        served, prompts, params, extras.n, request_stop + stop, body.priority, tenant, lora, model, extras.stream,
        include_usage, stream_interval, extras.return_token_ids,
    )  # fmt: skip


def _check_lengths(extras: SamplingRequest, max_tokens: int, field: str, context: int) -> None:
    if extras.min_tokens > context:
        raise bad(f"'min_tokens' must be at most {context}, got {extras.min_tokens}", "min_tokens")
    for name in ("stream_options", "stream_interval"):
        if getattr(extras, name) is not None and not extras.stream:
            raise bad(f"'{name}' is only allowed with 'stream': true", name)
    if max_tokens > context:
        raise bad(f"'{field}' must be at most {context}, got {max_tokens}", field)
    if extras.min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({extras.min_tokens}) must not exceed the maximum tokens ({max_tokens})", "min_tokens")


def check_model(model: str | None, served: Server) -> LoraAdapter | None:
    """The LoRA adapter `model` names (None: the base model); a model this server does not serve is a 404,
    as OpenAI and vLLM answer it."""
    base = served.engine.model_name
    if model is None or model == base:
        return None
    adapter = served.engine.loras.get(model)
    if adapter is None:
        also = "".join(f", {a.name!r}" for a in served.engine.loras.adapters())
        message = f"the model {model!r} does not exist here: this server serves {base!r}{also} (or omit 'model')"
        raise ApiError(404, message, param="model", code="model_not_found")
    return adapter


def _prompts(prompt: Prompt, tokenizer: tiktoken.Encoding) -> list[list[int]]:
    """A string, a list of token ids, or a list of either (the shapes the bodies allow): each prompt's ids."""
    many = isinstance(prompt, list) and not isinstance(prompt[0], int)
    items = prompt if many else [prompt]
    if any(isinstance(p, list) and p and not 0 <= min(p) <= max(p) < tokenizer.n_vocab for p in items):
        raise bad(f"'prompt' token ids must be from 0 to {tokenizer.n_vocab - 1}", "prompt")
    return [encode_prompt(tokenizer, p) if isinstance(p, str) else p for p in items]


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    entries = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise bad(f"'logit_bias' keys must be token ids below {vocab}, got {key!r}", "logit_bias")
        entries.append((token, value))
    return tuple(entries)
