"""The request fields /v1/completions and /v1/chat/completions share: model, n, sampling, stop, streaming.

Names and ranges follow OpenAI's API reference; `top_k`, `min_tokens`, `repetition_penalty` and
`ignore_eos` are vLLM's extras. Every problem is a 400 naming its field.
"""

from typing import Any, NamedTuple

from api.priority import parse_priority
from api.serving import Server
from api.validation import bad, boolean, integer, number, optional_seed

MAX_N = 16  # completions of one prompt in one request
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI
LOGIT_BIAS_LIMIT = 100.0  # |bias|: -100 bans a token, 100 all but forces it

SHARED_FIELDS = frozenset(
    {
        "model",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "priority",  # vLLM's: lower is more urgent (api/priority.py)
        "user",  # OpenAI's end-user id for abuse monitoring: accepted, and changes nothing
    }
)


class SharedFields(NamedTuple):
    n: int
    sampling: dict[str, Any]  # SamplingParams fields, all but max_tokens, min_tokens and the logprobs
    min_tokens: int  # checked against max_tokens once the endpoint knows it
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # streaming: a last event with the token counts
    priority: int


def parse_shared(body: dict, srv: Server) -> SharedFields:
    model = body.get("model")
    if model is not None and model != srv.engine.model_name:
        raise bad(f"'model' must be {srv.engine.model_name!r} (the served model) or omitted, got {model!r}", "model")
    if "user" in body and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    stream = boolean(body, "stream", False)
    vocab = srv.tokenizer.n_vocab
    top_k = integer(body, "top_k", 0, -1, vocab)
    sampling = {
        "temperature": number(body, "temperature", 1.0, 0.0, 2.0),
        "top_k": max(top_k, 0),  # vLLM's -1 means off, as 0 does
        "top_p": number(body, "top_p", 1.0, 1e-9, 1.0),
        "seed": optional_seed(body),
        "stop_at_eos": not boolean(body, "ignore_eos", False),
        "presence_penalty": number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        "logit_bias": _logit_bias(body.get("logit_bias", {}), vocab),
    }
    return SharedFields(
        n=integer(body, "n", 1, 1, MAX_N),
        sampling=sampling,
        min_tokens=integer(body, "min_tokens", 0, 0, srv.engine.max_context),
        stop=_stop_strings(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        priority=parse_priority(body),
    )


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({min_tokens}) must not exceed the maximum tokens ({max_tokens})", "min_tokens")


def _logit_bias(bias: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias")
    entries = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise bad(f"'logit_bias' keys must be token ids below {vocab}, got {key!r}", "logit_bias")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise bad(f"'logit_bias' values must be numbers from -100 to 100, got {value!r}", "logit_bias")
        entries.append((token, float(value)))
    return tuple(entries)


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
