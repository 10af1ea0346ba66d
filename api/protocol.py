"""The request bodies of /v1/completions and /v1/chat/completions, each declared once (as vLLM's protocol.py).

Names and static ranges follow OpenAI's API reference; `top_k`, `min_tokens`, `repetition_penalty`,
`ignore_eos` and the `guided_*` fields are vLLM's extras. What depends on the served model (its
name, vocabulary, context) is checked after, by the endpoint. Validation is strict: no string is
read as a number, no number as a boolean, no field is unknown. `parse` turns the first problem into
a 400 whose `param` is the field's top-level name, so every problem names its field.
"""

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.priority import PRIORITY_LIMIT
from api.validation import ApiError, bad, json_object

MAX_N = 16  # completions of one prompt in one request
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI
LOGIT_BIAS_LIMIT = 100.0  # |bias|: -100 bans a token, 100 all but forces it
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat completions
MAX_PROMPTS = 64  # prompts in one completions request
MAX_TOOLS = 128  # as OpenAI


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


NonEmpty = Annotated[str, Field(min_length=1)]
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


class SamplingRequest(Strict):
    """The fields both endpoints share: model, n, sampling, stop, streaming, one constraint."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=1e-9, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's -1 means off, as 0 does; at most the vocabulary (checked by the endpoint)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]], Field(max_length=MAX_LOGIT_BIAS)
    ] = {}
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    user: str | None = None  # OpenAI's end-user id: names the request's tenant when its API key does not
    priority: int = Field(0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)  # vLLM's: lower is more urgent
    return_token_ids: bool = False  # vLLM's: choices carry their "token_ids" (and the prompt's)
    guided_json: dict[str, Any] | str | None = None  # a JSON Schema, or its JSON text
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None  # Lark (vLLM's tests) or GBNF/EBNF (xgrammar's), told apart by syntax
    guided_whitespace_pattern: str | None = None  # JSON constraints: the whitespace allowed between tokens
    structured_outputs: StructuredOutputs | None = None


class CompletionBody(SamplingRequest):
    prompt: NonEmpty | TokenIds | Annotated[list[NonEmpty | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)


# --- chat ----------------------------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class CalledFunction(Strict):
    name: NonEmpty
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Strict):
    id: NonEmpty
    type: Literal["function"]
    function: CalledFunction


class SystemMessage(Strict):
    role: Literal["system", "developer"]  # developer: OpenAI's newer name for system messages
    content: Content


class UserMessage(Strict):
    role: Literal["user"]
    content: Content


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Content | None = None  # null when the turn only called tools
    tool_calls: list[ToolCall] = []


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: NonEmpty  # which call this answers


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # as OpenAI


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = {"type": "object"}  # a JSON Schema for the arguments; none: any object
    strict: bool | None = None  # arguments always follow the schema here


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaSpec(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # output always follows the schema here


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatBody(SamplingRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None or true: a reply may make several calls; false: one at most


# --- parsing -------------------------------------------------------------------------------------

# What a field with several accepted shapes must be, said once rather than once per shape tried.
SHAPES = {
    "prompt": f"a non-empty string or list of token ids, or a list of at most {MAX_PROMPTS} of them",
    "stop": f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
    "guided_json": "a JSON Schema: an object, or its JSON text",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids to numbers from -100 to 100",
}

Body = TypeVar("Body", bound=Strict)


def parse(cls: type[Body], body: Any, where: str) -> Body:
    """The body as `cls`; a null field counts as absent. The first problem is a 400 naming its field."""
    fields = json_object(body)
    try:
        return cls.model_validate(fields)
    except ValidationError as err:
        raise _problem(err.errors()[0], where) from None


def _problem(error: dict, where: str) -> ApiError:
    loc = error["loc"]
    field = str(loc[0])
    if error["type"] == "extra_forbidden" and len(loc) == 1:
        return bad(f"unknown or unsupported field '{field}' for {where}", field)
    if error["type"] == "missing":
        return bad(f"'{_path(loc)}' is required", field)
    got = repr(error["input"])
    got = got if len(got) <= 80 else got[:77] + "..."
    if field in SHAPES:
        return bad(f"'{field}' must be {SHAPES[field]}, got {got}", field)
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
