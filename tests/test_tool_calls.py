"""Tool calls as text (api/tool_calls.py), the chat template's tool keys, the request models' errors, and
which grammar syntax a guided_grammar is in: no server needed."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.chat_protocol import ChatBody
from api.chat_template import ChatTemplate
from api.errors import ApiError
from api.protocol import CompletionBody, parse
from api.structured import grammar_kind, guided
from api.tool_calls import Call, Calls, StreamedReply, call_json, call_schema, split_reply

TEMPLATE = ChatTemplate.load()
OPENER = TEMPLATE.call_opener
ARGS = {"city": "Oslo", "days": [1, 2], "where": {"lat": 59.9, "note": 'a } and " inside'}}


SEPARATOR = TEMPLATE.call_closer + OPENER
FORCED, AUTO = Calls(None, SEPARATOR, TEMPLATE.call_closer), Calls(OPENER, SEPARATOR, TEMPLATE.call_closer)


def test_a_whole_call_reads_back_with_its_arguments_as_written():
    arguments = json.dumps(ARGS)
    for calls in (Calls(None), FORCED):
        content, read = split_reply(call_json("get_weather", arguments), calls)
        assert content is None and read == [Call("get_weather", arguments)]
        assert json.loads(read[0].arguments) == ARGS


def test_auto_splits_content_before_the_opener_from_the_call():
    text = "Let me look. " + OPENER + call_json("f", '{"x": 1}')
    assert split_reply(text, AUTO) == ("Let me look. ", [Call("f", '{"x": 1}')])
    assert split_reply("no call here", AUTO) == ("no call here", [])


def test_parallel_calls_read_back_in_order_and_a_separator_inside_a_string_is_not_a_boundary():
    tricky = json.dumps({"s": SEPARATOR + '{"name": "g"'})
    text = call_json("f", '{"x": 1}') + SEPARATOR + call_json("g", tricky) + SEPARATOR + call_json("f", "{}")
    assert split_reply(text, FORCED) == (None, [Call("f", '{"x": 1}'), Call("g", tricky), Call("f", "{}")])
    # one call at most (parallel_tool_calls false): what follows the first call is not a call
    assert split_reply(text, Calls(None)) == (text, [])


@pytest.mark.parametrize("cut", [5, 20, -3])
def test_a_call_cut_short_is_no_call_and_the_text_stays(cut):
    text = call_json("f", json.dumps(ARGS))[:cut]
    assert split_reply(text, FORCED) == (text, [])
    assert split_reply("hi " + OPENER + text, AUTO) == ("hi " + OPENER + text, [])
    # a whole call then a cut one: no call is reported, not the whole one alone
    two = call_json("f", "{}") + SEPARATOR + text
    assert split_reply(two, FORCED) == (two, [])


def streamed(text: str, calls: Calls, cuts: list[int]) -> tuple[str, list[dict], list[str]]:
    """The content, each call's first tool_calls piece (id, name) and its joined arguments, that a
    stream gives for `text` delivered in pieces ending at `cuts`."""
    reply, content, firsts, arguments = StreamedReply(calls), "", [], []
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        delta = reply.delta(text[:end], finished=end == len(text))
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(firsts)
                firsts.append(piece)
                arguments.append("")
            arguments[piece["index"]] += piece["function"]["arguments"]
    return content, firsts, arguments


@given(
    args=st.lists(
        st.dictionaries(
            st.text(max_size=5), st.recursive(st.integers() | st.text(max_size=6), lambda x: st.lists(x, max_size=3))
        ),
        min_size=1,
        max_size=3,
    ),
    before=st.text(alphabet="ab <_tol>{}", max_size=12).filter(lambda t: OPENER not in t),
    cuts=st.lists(st.integers(0, 300), max_size=30),
    auto=st.booleans(),
)
def test_streamed_pieces_join_to_the_whole_reply_however_the_text_is_cut(args, before, cuts, auto):
    text = SEPARATOR.join(call_json(f"f{i}", json.dumps(a)) for i, a in enumerate(args))
    text = before + OPENER + text if auto else text
    calls = AUTO if auto else FORCED
    content, firsts, arguments = streamed(text, calls, cuts)
    whole_content, whole_calls = split_reply(text, calls)
    assert content == (whole_content or "") and arguments == [c.arguments for c in whole_calls]
    assert len({f["id"] for f in firsts}) == len(args) and all(f["id"].startswith("call_") for f in firsts)
    assert [f["function"]["name"] for f in firsts] == [f"f{i}" for i in range(len(args))]
    assert [json.loads(a) for a in arguments] == args


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


def test_each_functions_definitions_keep_their_own_meaning_in_the_call_schema():
    def tool(name: str, kind: str) -> dict:
        parameters = {"$defs": {"P": {"type": kind}}, "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    body = {"messages": MESSAGES, "tools": [tool("a", "integer"), tool("b", "string")]}
    schema = call_schema(parse(ChatBody, body, "chat").tools)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate({"name": "a", "arguments": {"p": 1}}, schema)
    jsonschema.validate({"name": "b", "arguments": {"p": "s"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "arguments": {"p": "s"}}, schema)


@pytest.mark.parametrize(
    ("given", "kind"),
    [({"json": {"type": "object"}}, "json_schema"), ({"regex": "a+"}, "regex"), ({"choice": ["a"]}, "choice")]
    + [({"grammar": "start: /a/"}, "lark"), ({"json_object": True}, "json_object")],
)
def test_vllms_structured_outputs_field_asks_for_the_same_constraints(given, kind):
    body = parse(ChatBody, {"messages": MESSAGES, "structured_outputs": given}, "chat")
    ((field, constraint),) = guided(body)
    assert field == "structured_outputs" and constraint.kind == kind


@pytest.mark.parametrize("given", [{}, {"regex": "a", "choice": ["a"]}, {"regex": "a", "whitespace_pattern": " "}])
def test_structured_outputs_must_give_one_constraint(given):
    body = parse(ChatBody, {"messages": MESSAGES, "structured_outputs": given}, "chat")
    with pytest.raises(ApiError) as caught:
        guided(body)
    assert caught.value.status == 400 and caught.value.param == "structured_outputs"
