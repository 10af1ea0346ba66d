"""Structured output and tool calls as application code writes them, with the official `openai` SDK and
LangChain's `ChatOpenAI`, unmodified, against the shared real server (./server.sh dynamic, tiny random
checkpoint): every answer parses into its pydantic model and every requested call is a call, greedy and
at temperature 1 (seeded, so a run is repeatable).

The models are what pydantic writes, without `additionalProperties`: their objects close because the
server closes objects by default. Their strings and numbers are bounded: random weights would
otherwise write a string for ever. Greedy decoding with parallel calls allowed is not among the cases:
random weights then choose another call after every call until max_tokens (finish_reason "length", no
calls, as vLLM answers it; test_structured_api.py checks that answer)."""

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")

from model.tokenizer import load_tokenizer  # noqa: E402 - after the skip

MESSAGES = [{"role": "user", "content": "Weather in Oslo for two days, please."}]
MAX_TOKENS = 160  # a call of these models is ~30 tokens
PARALLEL_MAX_TOKENS = 600  # parallel calls: random weights choose after each call whether to call again
SAMPLING = {"greedy": {"temperature": 0.0, "seed": 1}, "temperature_1": {"temperature": 1.0, "seed": 7}}


class Place(BaseModel):
    name: str = Field(max_length=6)


class Weather(BaseModel):
    """The forecast for a city."""

    city: Literal["Oslo", "Paris", "Rome"]
    days: int = Field(ge=1, le=7)
    place: Place  # a nested model: $defs and $ref in the schema
    unit: Literal["C", "F"] = "C"  # optional


class Time(BaseModel):
    """The time in a zone."""

    zone: str = Field(max_length=5)


MODELS = {"Weather": Weather, "Time": Time}


def tool(model: type[BaseModel]) -> dict:
    """A tool whose parameters are `model_json_schema()` as it is: no additionalProperties anywhere."""
    return {"type": "function", "function": {"name": model.__name__, "parameters": model.model_json_schema()}}


# --- openai -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLING)
def test_openai_parse_fills_the_pydantic_response_format(client, model, sampling):
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Weather, max_tokens=MAX_TOKENS, **SAMPLING[sampling]
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_openai_strict_pydantic_tools_come_back_parsed(client, model, sampling):
    import openai

    tools = [openai.pydantic_function_tool(Weather), openai.pydantic_function_tool(Time)]
    parallel = sampling != "greedy"  # see the module's note
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=parallel,
        max_tokens=PARALLEL_MAX_TOKENS if parallel else MAX_TOKENS, **SAMPLING[sampling],
    )  # fmt: skip
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert isinstance(call.function.parsed_arguments, MODELS[call.function.name])


NAMED = {"type": "function", "function": {"name": "Weather"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("sampling", "tool_choice", "parallel"),
    [
        ("greedy", NAMED, None),
        ("temperature_1", NAMED, None),
        ("greedy", "required", False),
        ("temperature_1", "required", False),
        ("temperature_1", "required", None),
    ],
)
def test_openai_tools_from_model_json_schema_are_calls(client, model, sampling, stream, tool_choice, parallel):
    args = dict(model=model, messages=MESSAGES, tools=[tool(Weather), tool(Time)], tool_choice=tool_choice)
    room = PARALLEL_MAX_TOKENS if tool_choice == "required" and parallel is None else MAX_TOKENS
    args |= dict(max_tokens=room, **SAMPLING[sampling])
    args |= {} if parallel is None else {"parallel_tool_calls": parallel}
    finish_reason, calls = streamed_calls(client, args) if stream else whole_calls(client, args)
    assert finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert calls and len({call_id for call_id, _, _ in calls}) == len(calls)
    assert len(calls) == 1 or (tool_choice == "required" and parallel is None)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        MODELS[name].model_validate_json(arguments)
        assert isinstance(tool_choice, str) or name == "Weather"


def whole_calls(client, args: dict) -> tuple[str, list[tuple[str, str, str]]]:
    (choice,) = client.chat.completions.create(**args).choices
    calls = choice.message.tool_calls or []
    return choice.finish_reason, [(c.id, c.function.name, c.function.arguments) for c in calls]


def streamed_calls(client, args: dict) -> tuple[str, list[tuple[str, str, str]]]:
    """Calls joined from `delta.tool_calls` pieces by their index, as the SDK's users join them."""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for piece in choice.delta.tool_calls or []:
                if piece.id:
                    assert piece.index not in calls
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                calls[piece.index][2] += piece.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return finish_reason, [tuple(calls[i]) for i in sorted(calls)]


# --- langchain-openai ---------------------------------------------------------------------------------


def chat_model(url: str, model: str, sampling: str, max_tokens: int = MAX_TOKENS, **kwargs):
    return langchain_openai.ChatOpenAI(
        base_url=f"{url}/v1", api_key="unused", model=model, max_tokens=max_tokens, max_retries=0,
        **SAMPLING[sampling], **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_gives_the_model(url, model, sampling, method):
    structured = chat_model(url, model, sampling).with_structured_output(Weather, method=method)
    assert isinstance(structured.invoke("Weather in Oslo?"), Weather)


def test_langchain_json_mode_gives_an_object_that_parses(url, model):
    """json_mode sends no schema (any JSON object): random weights close the object only when a bias
    makes the reply `{}` soon; the model's fields all have defaults then."""

    class Loose(BaseModel):
        city: str = "Oslo"

    close = {str(load_tokenizer().encode(c)[0]): 100 for c in "}"}
    llm = chat_model(url, model, "greedy", logit_bias=close)
    assert isinstance(llm.with_structured_output(Loose, method="json_mode").invoke("Weather?"), Loose)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("tool_choice", ["Weather", "any"])
@pytest.mark.parametrize("stream", [False, True])
def test_langchain_bind_tools_makes_the_calls_asked_for(url, model, sampling, tool_choice, stream):
    greedy = sampling == "greedy"  # see the module's note
    parallel = {"parallel_tool_calls": False} if greedy else {}
    llm = chat_model(url, model, sampling, MAX_TOKENS if greedy else PARALLEL_MAX_TOKENS)
    llm = llm.bind_tools([Weather, Time], tool_choice=tool_choice, **parallel)
    if stream:
        message = None
        for chunk in llm.stream("Weather in Oslo?"):
            message = chunk if message is None else message + chunk
    else:
        message = llm.invoke("Weather in Oslo?")
    assert message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        assert tool_choice == "any" or call["name"] == "Weather"
        MODELS[call["name"]].model_validate(call["args"])
        assert call["id"] and json.dumps(call["args"])
