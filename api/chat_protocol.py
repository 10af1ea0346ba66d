"""The request bodies that carry a chat: POST /v1/chat/completions and POST /tokenize (its `messages`), as
api/protocol.py declares the others (and parses them all)."""

from typing import Annotated, Any, Literal

from pydantic import Field

from api.protocol import NonEmpty, SamplingRequest, Strict

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat completions
MAX_TOOLS = 128  # as OpenAI


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


class TokenizeBody(Strict):
    """POST /tokenize: a text prompt, or a chat's messages through the template (exactly one of them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None  # non-empty (checked by the endpoint, after "one of them")
    add_special_tokens: bool = True  # GPT-2 adds none either way
    add_generation_prompt: bool = True  # false is refused: the template always opens the reply
