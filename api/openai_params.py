"""From a validated body (api/protocol.py) to what the engine takes: the checks that depend on the served model."""

from typing import NamedTuple

from api import tenants
from api.protocol import SamplingRequest
from api.serving import Server
from api.validation import ApiError, bad
from model.lora import LoraAdapter


class SharedFields(NamedTuple):
    n: int
    sampling: dict  # SamplingParams fields, all but max_tokens, min_tokens, the logprobs and the constraint
    min_tokens: int  # checked against max_tokens once the endpoint knows it
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # streaming: a last event with the token counts
    priority: int
    lora: LoraAdapter | None = None  # the adapter the request's "model" names; None: the base model
    return_token_ids: bool = False  # vLLM's: token ids beside the text (prompt_token_ids, token_ids)


def shared_fields(body: SamplingRequest, srv: Server) -> SharedFields:
    lora = check_model(body.model, srv)
    tenants.note_user(body.user)
    vocab = srv.tokenizer.n_vocab
    if body.top_k > vocab:
        raise bad(f"'top_k' must be between -1 and {vocab}, got {body.top_k}", "top_k")
    if body.min_tokens > srv.engine.max_context:
        raise bad(f"'min_tokens' must be at most {srv.engine.max_context}, got {body.min_tokens}", "min_tokens")
    if body.stream_options is not None and not body.stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    sampling = {
        "temperature": body.temperature,
        "top_k": max(body.top_k, 0),
        "top_p": body.top_p,
        "seed": body.seed,
        "stop_at_eos": not body.ignore_eos,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias, vocab),
    }
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return SharedFields(
        body.n, sampling, body.min_tokens, stop, body.stream, include_usage, body.priority, lora, body.return_token_ids
    )


def check_model(model: str | None, srv: Server) -> LoraAdapter | None:
    """The LoRA adapter `model` names (None: the base model); a model this server does not serve is a 404,
    as OpenAI and vLLM answer it."""
    served = srv.engine.model_name
    if model is None or model == served:
        return None
    adapter = srv.engine.loras.get(model)
    if adapter is None:
        also = "".join(f", {a.name!r}" for a in srv.engine.loras.adapters())
        message = f"the model {model!r} does not exist here: this server serves {served!r}{also} (or omit 'model')"
        raise ApiError(404, message, param="model", code="model_not_found")
    return adapter


def model_name(srv: Server, lora: LoraAdapter | None) -> str:
    """The "model" of a response: the adapter's name, or the base model's."""
    return srv.engine.model_name if lora is None else lora.name


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({min_tokens}) must not exceed the maximum tokens ({max_tokens})", "min_tokens")


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    entries = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab:
            raise bad(f"'logit_bias' keys must be token ids below {vocab}, got {key!r}", "logit_bias")
        entries.append((token, value))
    return tuple(entries)
