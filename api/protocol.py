"""Every endpoint's request body, each declared once (as vLLM's protocol.py); the chat bodies are in
api/chat_protocol.py.

Names and static ranges follow OpenAI's API reference; `top_k`, `min_tokens`, `repetition_penalty`,
`ignore_eos` and the `guided_*` fields are vLLM's extras. What depends on the served model (its
name, vocabulary, context) is checked after, by api/generation.py. Validation is strict: no string is
read as a number, no number as a boolean, no field is unknown. `parse` turns the first problem into
a 400 whose `param` is the field's top-level name, so every problem names its field.
"""

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from api.errors import ApiError, bad
from batching.batch_jobs import ENDPOINTS

MAX_N = 16  # completions of one prompt in one request
MAX_STOP_STRINGS = 4  # as OpenAI
# A stop string's characters, and all of a request's in UTF-8 bytes: each token's hold-back (batching/text_stream.py)
# is linear in them
MAX_STOP_CHARS = 1024
MAX_STOP_BYTES = 4096
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI
LOGIT_BIAS_LIMIT = 100.0  # |bias|: -100 bans a token, 100 all but forces it
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions
MAX_PROMPTS = 64  # prompts in one completions request
MAX_METADATA = 16  # a batch's metadata keys, as OpenAI
# The `priority` field (every generation endpoint): lower is more urgent, 0 by default, as vLLM's; the
# scheduler ranks by it (generate/priority.py). Batch API requests run at PRIORITY_LIMIT, the lowest.
PRIORITY_LIMIT = 1000


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


NonEmpty = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class StreamOptions(Strict):
    include_usage: bool = False


class StructuredOutputs(Strict):
    """vLLM's current field for one constraint (its guided_* fields' successor): exactly one of the kinds."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON Schema, or its JSON text
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class Sampling(Strict):
    """The fields every generation endpoint takes: which model, who asks, how urgent, how to sample."""

    model: str | None = None  # the base model's name or a LoRA adapter's; none: the base model
    user: str | None = None  # OpenAI's end-user id: names the request's tenant when its API key does not
    priority: int = Field(0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)  # vLLM's: lower is more urgent
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=1e-9, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's -1 means off, as 0 does; at most the vocabulary (api/generation.py)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


class InferenceBody(Sampling):
    """POST /inference, the original endpoint: one text prompt, num_tokens to generate."""

    prompt: NonEmpty
    num_tokens: int = Field(ge=1)  # at most the context (api/generation.py)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=50257)
    stop_at_eos: bool = False


class SamplingRequest(Sampling):
    """The fields both OpenAI endpoints share: n, sampling, stop, streaming, one constraint."""

    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(None, ge=1)  # vLLM's: tokens per streamed event, at least STREAM_INTERVAL
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]], Field(max_length=MAX_LOGIT_BIAS)
    ] = {}
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's: choices carry their "token_ids" (and the prompt's)
    guided_json: dict[str, Any] | str | None = None  # a JSON Schema, or its JSON text
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None  # Lark (vLLM's tests) or GBNF/EBNF (xgrammar's), told apart by syntax
    guided_whitespace_pattern: str | None = None  # JSON constraints: the whitespace allowed between tokens
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop_bytes(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if sum(len(s.encode()) for s in ([stop] if isinstance(stop, str) else stop or [])) > MAX_STOP_BYTES:
            raise ValueError("too long")
        return stop


class CompletionBody(SamplingRequest):
    prompt: NonEmpty | TokenIds | Annotated[list[NonEmpty | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class DetokenizeBody(Strict):
    model: str | None = None
    tokens: list[int]  # each below the vocabulary (checked by the endpoint)


LoraName = Annotated[str, Field(pattern=r"\S")]  # not blank


class LoadLoraBody(Strict):
    lora_name: LoraName
    lora_path: LoraName
    load_inplace: bool = False  # vLLM's; a loaded name is refused here either way


class UnloadLoraBody(Strict):
    lora_name: LoraName
    lora_int_id: int | None = None  # vLLM's; the name says which


class BatchBody(Strict):
    """POST /v1/batches: a batch over an uploaded file (whose purpose the endpoint checks)."""

    endpoint: Literal[ENDPOINTS]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    input_file_id: str


# --- parsing -------------------------------------------------------------------------------------

# What a field with several accepted shapes must be, said once rather than once per shape tried.
SHAPES = {
    "/inference prompt": "a non-empty string",
    "/tokenize prompt": "a string",
    "tokens": "a list of token ids",
    "prompt": f"a non-empty string or list of token ids, or a list of at most {MAX_PROMPTS} of them",
    "stop": (
        f"a non-empty string of at most {MAX_STOP_CHARS} characters or a list of at most {MAX_STOP_STRINGS} "
        f"of them, {MAX_STOP_BYTES} bytes (UTF-8) in all"
    ),
    "guided_json": "a JSON Schema: an object, or its JSON text",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids to numbers from -100 to 100",
    "lora_name": "a non-empty string",
    "lora_path": "a non-empty string",
    "endpoint": f"one of {', '.join(ENDPOINTS)}",
    "completion_window": "'24h'",
    "metadata": f"an object of at most {MAX_METADATA} string values",
}

Body = TypeVar("Body", bound=Strict)


def parse(cls: type[Body], body: Any, where: str) -> Body:
    """The body as `cls`; a null field counts as absent, as OpenAI's clients send it for "not given".
    The first problem is a 400 naming its field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    fields = {name: value for name, value in body.items() if value is not None}
    try:
        return cls.model_validate(fields)
    except ValidationError as err:
        raise _problem(err.errors()[0], where) from None


def _problem(error: dict, where: str) -> ApiError:
    loc = error["loc"]
    field = str(loc[0])
    if error["type"] == "extra_forbidden" and len(loc) == 1:
        return bad(f"unknown or unsupported field '{field}' for {where}", field)
    shape = SHAPES.get(f"{where} {field}", SHAPES.get(field)) if len(loc) == 1 or error["type"] != "missing" else None
    if error["type"] == "missing":
        return bad((f"'{field}' must be {shape}; it " if shape else f"'{_path(loc)}' ") + "is required", field)
    got = repr(error["input"])
    got = got if len(got) <= 80 else got[:77] + "..."
    if shape is not None:
        return bad(f"'{field}' must be {shape}, got {got}", field)
    return bad(f"'{_path(loc)}': {error['msg'][0].lower()}{error['msg'][1:]}, got {got}", field)


def _path(loc: tuple) -> str:
    """messages[2].content, from a location that may name union members between the fields."""
    parts = [p for i, p in enumerate(loc) if i == 0 or not _is_tag(p) and p != loc[i - 1]]
    return str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:])


def _is_tag(part: Any) -> bool:
    """A union member's name in a location (e.g. 'user' for a message of that role), not a field: a tag repeats
    no field's name but json_schema's, which the caller drops where it repeats."""
    return isinstance(part, str) and (part in TAGS or "[" in part)


TAGS = frozenset({"system", "developer", "user", "assistant", "tool", "text", "json_object", "str"})
