"""Tool calls as text (api/tool_calls.py), the chat template's tool keys, the request models' errors, and
which grammar syntax a guided_grammar is in: no server needed."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.chat_template import ChatTemplate
from api.protocol import ChatBody, CompletionBody, parse
from api.structured import grammar_kind
from api.tool_calls import StreamedReply, call_json, call_schema, split_reply
from api.validation import ApiError

TEMPLATE = ChatTemplate.load()
OPENER = TEMPLATE.call_opener
ARGS = {"city": "Oslo", "days": [1, 2], "where": {"lat": 59.9, "note": 'a } and " inside'}}


def test_a_whole_call_reads_back_with_its_arguments_as_written():
    arguments = json.dumps(ARGS)
    content, call = split_reply(call_json("get_weather", arguments), None)
    assert content is None and call.name == "get_weather" and call.arguments == arguments
    assert json.loads(call.arguments) == ARGS


def test_auto_splits_content_before_the_opener_from_the_call():
    text = "Let me look. " + OPENER + call_json("f", '{"x": 1}')
    content, call = split_reply(text, OPENER)
    assert content == "Let me look. " and (call.name, call.arguments) == ("f", '{"x": 1}')
    assert split_reply("no call here", OPENER) == ("no call here", None)


@pytest.mark.parametrize("cut", [5, 20, -3])
def test_a_call_cut_short_is_no_call_and_the_text_stays(cut):
    text = call_json("f", json.dumps(ARGS))[:cut]
    assert split_reply(text, None) == (text, None)
    assert split_reply("hi " + OPENER + text, OPENER) == ("hi " + OPENER + text, None)


def streamed(text: str, opener: str | None, cuts: list[int]) -> tuple[str, dict | None, str]:
    """The content, the first tool_calls piece (id, name) and the joined arguments a stream gives for
    `text` delivered in pieces ending at `cuts`."""
    reply, content, first, arguments = StreamedReply(opener), "", None, ""
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        delta = reply.delta(text[:end], finished=end == len(text))
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            assert piece["index"] == 0
            first = first or piece
            arguments += piece["function"]["arguments"]
    return content, first, arguments


@given(
    args=st.dictionaries(
        st.text(max_size=5), st.recursive(st.integers() | st.text(max_size=6), lambda x: st.lists(x, max_size=3))
    ),
    before=st.text(alphabet="ab <_tol>{}", max_size=12).filter(lambda t: OPENER not in t),
    cuts=st.lists(st.integers(0, 200), max_size=30),
    auto=st.booleans(),
)
def test_streamed_pieces_join_to_the_whole_reply_however_the_text_is_cut(args, before, cuts, auto):
    call = call_json("lookup", json.dumps(args))
    text = before + OPENER + call if auto else call
    opener = OPENER if auto else None
    content, first, arguments = streamed(text, opener, cuts)
    whole_content, whole_call = split_reply(text, opener)
    assert content == (whole_content or "") and arguments == whole_call.arguments
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "lookup" and json.loads(arguments) == args


def test_call_schema_ties_each_name_to_its_own_arguments():
    jsonschema = pytest.importorskip("jsonschema")
    tools = parse(ChatBody, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, "chat").tools
    schema = call_schema(tools)
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, schema)
    jsonschema.validate({"name": "b", "arguments": {"y": "s"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "arguments": {"y": "s"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "b", "arguments": {"y": "s"}}, call_schema(tools, "a"))


def function(name: str, field: str, kind: str) -> dict:
    parameters = {"type": "object", "properties": {field: {"type": kind}}, "required": [field]}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [function("a", "x", "integer"), function("b", "y", "string")]


# --- the chat template's tool keys ------------------------------------------------------------------


def test_the_default_template_writes_tools_calls_and_results_and_a_forced_call_continues_the_reply():
    text = TEMPLATE.render(
        [("user", "hi"), ("assistant", TEMPLATE.call(call_json("a", '{"x": 1}'))), ("tool", "42")], ['{"name": "a"}']
    )
    assert text == (
        'Functions you can call, one JSON per line:\n{"name": "a"}\n\n'
        'User: hi\nAssistant: <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\nTool: 42\nAssistant:'
    )
    assert TEMPLATE.forced_call_prefix == " <tool_call>" and TEMPLATE.call_closer == "</tool_call>"


def test_a_template_may_define_its_own_call_syntax(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        'system = "{content}\\n"\nuser = "Q: {content}\\n"\nassistant = "A:{content}\\n"\nreply = "A:"\n'
        'stop = ["\\nQ:"]\ntool = "R: {content}\\n"\ntool_call = "CALL {call} END"\n'
    )
    template = ChatTemplate.load(str(path))
    assert template.call_opener == "CALL " and template.forced_call_prefix == "CALL "
    assert template.render([("tool", "x")]) == "R: x\nA:"


@pytest.mark.parametrize(
    ("extra", "problem"),
    [('tool_call = "{call}"', "open with text"), ('tool = "no placeholder"', "tool must be a string with one")],
)
def test_a_broken_tool_key_is_refused(tmp_path, extra, problem):
    path = tmp_path / "t.toml"
    path.write_text(
        'system = "{content}"\nuser = "{content}"\nassistant = "{content}"\nreply = "A:"\nstop = ["x"]\n' + extra
    )
    with pytest.raises(ValueError, match=problem):
        ChatTemplate.load(str(path))


# --- request models ---------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("cls", "body", "param", "fragment"),
    [
        (CompletionBody, {"prompt": "a", "n": True}, "n", "'n'"),
        (CompletionBody, {"prompt": "a", "temperature": "1"}, "temperature", "valid number"),
        (CompletionBody, {"prompt": "a", "guided_choice": []}, "guided_choice", "at least 1"),
        (CompletionBody, {"prompt": "a", "guided_choice": ["x", 1]}, "guided_choice", "guided_choice[1]"),
        (CompletionBody, {"prompt": "a", "guided_json": 5}, "guided_json", "JSON Schema"),
        (CompletionBody, {"prompt": "a", "priority": "high"}, "priority", "'priority'"),
        (CompletionBody, {"prompt": "a", "response_format": {"type": "text"}}, "response_format", "unknown"),
        (ChatBody, {"messages": MESSAGES, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        (ChatBody, {"messages": [{"role": "bot", "content": "x"}]}, "messages", "'messages[0]'"),
        (ChatBody, {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, "messages", "is required"),
        (ChatBody, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format", "required"),
    ],
)
def test_each_problem_is_a_400_naming_its_field(cls, body, param, fragment):
    with pytest.raises(ApiError) as caught:
        parse(cls, body, "here")
    assert caught.value.status == 400 and caught.value.param == param and fragment in str(caught.value)


def test_null_fields_are_not_given_and_priority_defaults_to_zero():
    body = parse(ChatBody, {"messages": MESSAGES, "tools": None, "temperature": None, "priority": None}, "chat")
    assert body.tools is None and body.temperature == 1.0 and body.priority == 0
    assert parse(CompletionBody, {"prompt": "a", "priority": 3}, "c").priority == 3


@pytest.mark.parametrize(
    ("grammar", "kind"),
    [
        ('root ::= "a" | "b"', "ebnf"),
        ('# sql\nroot ::= select\nselect ::= "SELECT"', "ebnf"),
        ('start: select_statement\nselect_statement: "SELECT " column\ncolumn: "col_1" | "col_2"', "lark"),
        ("start: /[0-9]+/", "lark"),
    ],
)
def test_a_grammars_syntax_is_told_by_how_its_rules_are_written(grammar, kind):
    assert grammar_kind(grammar) == kind
