"""Closed objects (generate/closed_objects.py): an object schema that declares properties and says
nothing of others admits only those, in guided JSON, tool calls and parallel tool calls; a schema that
opens its objects keeps them open; STRUCTURED_OPEN_OBJECTS restores the spec. Acceptance is judged by
feeding a text's tokens to the compiled constraint; the texts are written by hand. No server needed."""

import json

import jsonschema
import pytest

from api.chat_protocol import ChatBody
from api.protocol import parse
from api.tool_calls import call_schema
from config import EngineSettings
from generate.closed_objects import close_objects
from generate.constraint_compiler import ConstraintCompiler
from generate.constraints import Constraint, ConstraintError
from model.tokenizer import load_tokenizer

compile_constraint = ConstraintCompiler(EngineSettings()).compile  # an engine's, without the engine

TOKENIZER = load_tokenizer()

# what pydantic writes for `class Weather(BaseModel): city: str; days: int = 1` with a nested model
PYDANTIC = {
    "$defs": {"Place": {"properties": {"name": {"type": "string"}}, "required": ["name"], "type": "object"}},
    "properties": {
        "city": {"title": "City", "type": "string"},
        "days": {"default": 1, "title": "Days", "type": "integer"},
        "place": {"$ref": "#/$defs/Place"},
    },
    "required": ["city", "place"],
    "title": "Weather",
    "type": "object",
}


def accepts(constraint: Constraint, text: str) -> bool:
    """Whether the constraint admits `text` as a whole output."""
    matcher = compile_constraint(constraint).matcher()
    tokens = TOKENIZER.encode(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


def schema(s: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


@pytest.fixture
def open_objects(monkeypatch):
    monkeypatch.setitem(
        globals(), "compile_constraint", ConstraintCompiler(EngineSettings(structured_open_objects=True)).compile
    )


def test_a_pydantic_schema_admits_its_declared_keys_and_nothing_more():
    c = schema(PYDANTIC)
    assert accepts(c, '{"city": "Oslo", "days": 2, "place": {"name": "x"}}')
    assert accepts(c, '{"city": "Oslo", "place": {"name": "x"}}')
    assert not accepts(c, '{"city": "Oslo", "place": {"name": "x"}, "extra": 1}')
    assert not accepts(c, '{"city": "Oslo", "place": {"name": "x", "extra": 1}}')  # through $ref too


def test_a_schema_that_opens_its_objects_keeps_them_open():
    for extras in (True, {"type": "integer"}):
        c = schema({**PYDANTIC, "additionalProperties": extras})
        assert accepts(c, '{"city": "Oslo", "place": {"name": "x"}, "extra": 1}')
    c = schema({**PYDANTIC, "additionalProperties": {"type": "integer"}})
    assert not accepts(c, '{"city": "Oslo", "place": {"name": "x"}, "extra": "s"}')
    assert accepts(schema({"type": "object"}), '{"anything": [1, 2]}')  # declares nothing: any object


def test_the_setting_restores_the_specs_open_objects(open_objects):
    assert accepts(schema(PYDANTIC), '{"city": "Oslo", "place": {"name": "x", "extra": 1}, "more": null}')


@pytest.mark.parametrize("kind", ["tool_auto", "tool_calls"])
def test_tool_call_arguments_are_closed_and_parallel_calls_each_fit(kind):
    tool = {"type": "function", "function": {"name": "weather", "parameters": PYDANTIC}}
    call = call_schema(parse(ChatBody, {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}, "c").tools)
    spec = {"schema": call, "separator": "</c><c>"} | ({"trigger": "<c>"} if kind == "tool_auto" else {})
    c = Constraint(kind, json.dumps(spec))
    one = '{"name": "weather", "arguments": {"city": "Oslo", "place": {"name": "x"}}}'
    lead = "Sure. <c>" if kind == "tool_auto" else ""
    assert accepts(c, lead + one) and accepts(c, lead + one + "</c><c>" + one)
    assert not accepts(c, lead + one.replace('"x"}', '"x", "extra": 1}'))
    assert not accepts(c, lead + one + "</c><c>")  # a separator promises another call
    assert not accepts(c, lead + one + "</c><c>" + one[:-1] + ', "x": 2}')


def test_without_a_separator_a_reply_makes_one_call_at_most():
    call = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = Constraint("tool_auto", json.dumps({"trigger": "<c>", "schema": call}))
    assert accepts(c, 'hi <c>{"a": 1}') and not accepts(c, 'hi <c>{"a": 1}</c><c>{"a": 2}')
    with pytest.raises(ConstraintError, match="separator"):
        compile_constraint(Constraint("tool_calls", json.dumps({"schema": call})))


def test_closing_leaves_all_of_members_and_the_input_alone():
    members = [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]
    original = {"allOf": members, "properties": {"c": {"properties": {"d": {}}}}}
    closed = close_objects(original)
    assert closed["allOf"] == members and "additionalProperties" not in closed
    assert closed["properties"]["c"]["additionalProperties"] is False
    assert "additionalProperties" not in original["properties"]["c"]
    jsonschema.validate({"a": 1, "b": 2}, closed)  # each member's keys still pass the other
    assert accepts(schema(original), '{"a": 1, "b": 2}')


def test_a_property_named_like_a_keyword_is_a_property():
    s = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}}
    closed = close_objects(s)
    inner = closed["properties"]["properties"]
    assert closed["additionalProperties"] is False and inner["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties"}
