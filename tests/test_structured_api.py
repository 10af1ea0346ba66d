"""Structured output through the official openai client against the shared real server (./server.sh dynamic on
the tiny random checkpoint): whatever the weights, every finished output fits its constraint, checked by
independent validators (jsonschema, re.fullmatch, a Lark parser)."""

import json
import re

import jsonschema
import lark
import openai
import pytest
import requests

from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
PROMPT = "The answer, as JSON:"
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array with min and max items": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums of strings and integers": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "$defs and $ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "nullable types": {
        "type": "object",
        "properties": {
            "note": {"type": ["string", "null"], "maxLength": 5},
            "count": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
        },
        "required": ["note", "count"],
        "additionalProperties": False,
    },
    "bounded strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 3, "maxLength": 3},
            "tag": {"type": "string", "pattern": "^[a-z]{2,5}$"},
        },
        "required": ["code", "tag"],
        "additionalProperties": False,
    },
}

SQL_LARK = """
start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column " = " number
number: "1" | "2"
"""
SQL_EBNF = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1" | "col_2"
table ::= "table_1" | "table_2"
condition ::= column " = " number
number ::= "1" | "2"
"""
SQL_PARSER = lark.Lark(SQL_LARK)


def finished_texts(client, model, stream: bool, **kwargs) -> list[str]:
    """Every choice's text of a completions request, n=2 at temperature 1, whole or streamed; each must
    have finished by its grammar (finish_reason "stop"), not by max_tokens."""
    args = dict(model=model, prompt=PROMPT, max_tokens=300, n=2, temperature=1.0, **kwargs)
    if stream:
        texts, reasons = ["", ""], [None, None]
        for chunk in client.completions.create(stream=True, **args):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        choices = client.completions.create(**args).choices
        texts, reasons = [c.text for c in choices], [c.finish_reason for c in choices]
    assert reasons == ["stop", "stop"], (reasons, texts)
    return texts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(client, model, name, stream):
    schema = SCHEMAS[name]
    for text in finished_texts(client, model, stream, extra_body={"guided_json": schema, "seed": 7}):
        jsonschema.validate(json.loads(text), schema)


def test_a_schema_as_json_text_and_a_whitespace_pattern(client, model):
    schema = SCHEMAS["enums of strings and integers"]
    extra = {"guided_json": json.dumps(schema), "guided_whitespace_pattern": r"[ ]?"}
    for text in finished_texts(client, model, False, extra_body=extra):
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s\s|\n", text)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammars_in_both_syntaxes(client, model, stream):
    regex = r"\d{3}-[a-z]{2,4}( [A-Z]{1,4})?"
    for text in finished_texts(client, model, stream, extra_body={"guided_regex": regex}):
        assert re.fullmatch(regex, text), text
    choices = ["red", "green", "blue", "dark purple"]
    for text in finished_texts(client, model, stream, extra_body={"guided_choice": choices}):
        assert text in choices
    for grammar in (SQL_LARK, SQL_EBNF):
        for text in finished_texts(client, model, stream, extra_body={"guided_grammar": grammar}):
            SQL_PARSER.parse(text)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_object_and_json_schema(client, model, stream):
    schema = SCHEMAS["nested objects"]
    # Any object may go on for ever with random weights: a bias towards quotes and braces closes it soon.
    close = {str(TOKENIZER.encode(c)[0]): 100 for c in '"}'}
    formats = [  # (response_format, logit_bias, check)
        ({"type": "json_object"}, close, lambda value: isinstance(value, dict)),
        (
            {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
            None,
            lambda value: jsonschema.validate(value, schema) is None,
        ),
    ]
    for response_format, bias, check in formats:
        args = dict(response_format=response_format, logit_bias=bias, max_tokens=300)
        for text in chat_texts(client, model, stream, **args):
            assert check(json.loads(text)), text


def chat_texts(client, model, stream: bool, **kwargs) -> list[str]:
    args = dict(model=model, messages=MESSAGES, n=2, temperature=1.0, **kwargs)
    if not stream:
        choices = client.chat.completions.create(**args).choices
        assert [c.finish_reason for c in choices] == ["stop", "stop"], choices
        return [c.message.content for c in choices]
    texts, reasons = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop", "stop"], (reasons, texts)
    return texts


# --- tool calls ---------------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


def calls_of(client, model, stream: bool, **kwargs) -> list[tuple[str, object, str]]:
    """Each choice's (finish_reason, tool_calls as [(id, name, arguments)], content), whole or streamed."""
    args = dict(model=model, messages=MESSAGES, tools=TOOLS, n=2, temperature=1.0, max_tokens=200) | kwargs
    if not stream:
        return [
            (
                c.finish_reason,
                [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                c.message.content,
            )
            for c in client.chat.completions.create(**args).choices
        ]
    calls: list[dict] = [{}, {}]
    reasons, contents = [None, None], ["", ""]
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            contents[choice.index] += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id:
                    assert call["id"] is None and piece.function.name  # the first piece names the call
                    call["id"], call["name"] = piece.id, piece.function.name
                call["arguments"] += piece.function.arguments or ""
    return [
        (reasons[i], [(c["id"], c["name"], c["arguments"]) for c in calls[i].values()], contents[i] or None)
        for i in range(2)
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_calls_are_valid_calls_of_an_offered_function(client, model, stream, parallel):
    """At least one call; several only when parallel calls are allowed (OpenAI's default), each its own id."""
    # With parallel calls random weights choose after each call whether to call again: room for many
    # calls, and a seed, so that the run is repeatable (a chain cut by max_tokens would be no call)
    extra = {"seed": 5, "max_tokens": 600} if parallel is None else {"parallel_tool_calls": parallel}
    for finish_reason, calls, content in calls_of(client, model, stream, tool_choice="required", **extra):
        assert finish_reason == "tool_calls" and content is None
        assert len(calls) >= 1 and (parallel is None or len(calls) == 1)
        assert len({call_id for call_id, _, _ in calls}) == len(calls)
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_") and name in PARAMETERS
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(client, model, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for finish_reason, calls, _ in calls_of(client, model, stream, tool_choice=choice):
        assert finish_reason == "stop"  # as OpenAI, when the request named the function
        ((_, name, arguments),) = calls
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), TIME)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_call_cut_by_max_tokens_is_no_call(client, model, tool_choice):
    """The answer is the text written so far, finish_reason "length", no tool_calls."""
    for finish_reason, calls, content in calls_of(client, model, False, tool_choice=tool_choice, max_tokens=4):
        assert finish_reason == "length" and calls == [] and content


def test_none_offers_no_tools_and_replies_in_text(client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == plain.choices[0].message.content


def test_auto_without_a_call_is_text_that_never_writes_the_opener(client, model):
    for finish_reason, calls, content in calls_of(client, model, False, tool_choice="auto", max_tokens=40):
        if not calls:  # a random model rarely writes "<tool_call>"; if it does, the call must be whole
            assert finish_reason in ("stop", "length") and "<tool_call>" not in (content or "")


def test_a_conversation_with_a_call_and_its_result_goes_through_the_template(url, client, model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "12:00"})
    tokens = requests.post(f"{url}/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    assert TOKENIZER.decode(tokens) == (
        'User: What is the weather in Oslo?\nAssistant: <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
        "</tool_call>\nTool: 12:00\nAssistant:"
    )
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=3)
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[*MESSAGES, {**messages[-1], "tool_call_id": "other"}])
    assert caught.value.body["param"] == "messages"


@pytest.fixture(scope="module")
def one_token_opener_url(tiny_checkpoint, tmp_path_factory):
    """A server whose template's call opener is one token (">>>")."""
    from client.launch import running_server

    directory = tmp_path_factory.mktemp("opener")
    template = directory / "template.toml"
    template.write_text(
        'system = "{content}\\n"\nuser = "User: {content}\\n"\nassistant = "Assistant: {content}\\n"\n'
        'reply = "Assistant:"\nstop = ["\\nUser:"]\ntool_call = ">>>{call}"\n'
    )
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "1024", "CHAT_TEMPLATE": str(template)}
    with running_server("dynamic", directory, **settings) as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_auto_constrains_the_call_once_the_reply_writes_the_opener(one_token_opener_url, stream):
    """A logit bias makes the reply write the one-token opener first: from there the grammar holds the reply
    to a call of an offered function. (One call: with parallel calls, the opener is also the separator
    between two, and the bias would make the reply call again after every call.)"""
    (opener,) = TOKENIZER.encode(">>>")
    client = openai.OpenAI(base_url=f"{one_token_opener_url}/v1", api_key="unused", max_retries=0)
    bias = {str(opener): 100}
    for finish_reason, calls, _ in calls_of(
        client, None, stream, tool_choice="auto", logit_bias=bias, parallel_tool_calls=False
    ):
        assert finish_reason == "tool_calls"
        ((_, name, arguments),) = calls
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


# --- the batch, equivalence, refusals -------------------------------------------------------------------


@pytest.fixture(scope="module")
def drawing_url(tiny_checkpoint, tmp_path_factory):
    """A server that draws every token (JUMP_FORWARD=off); the shared one appends the tokens a grammar forces."""
    from client.launch import running_server

    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096", "JUMP_FORWARD": "off"}
    with running_server("dynamic", tmp_path_factory.mktemp("drawing"), **settings) as url:
        yield url


def test_forced_tokens_come_with_the_token_before_them_and_change_no_output(url, drawing_url, model):
    """The same greedy output, whole and streamed, whether the grammar's forced tokens are drawn a step each or
    appended with the token before them; appended, a forced run streams in one event with that token."""

    def answer(base: str, stream: bool) -> tuple[str, int]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": stream}
        response = requests.post(
            f"{base}/v1/completions", json=body | {"guided_json": SCHEMAS["nested objects"]}, stream=stream, timeout=60
        )
        assert response.status_code == 200, response.text
        if not stream:
            answered = response.json()
            return answered["choices"][0]["text"], answered["usage"]["completion_tokens"]
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: {")]
        texts = [event["choices"][0]["text"] for event in events if event["choices"]]
        return "".join(texts), sum(1 for text in texts if text)

    (jumped, tokens), (drawn, drawn_tokens) = answer(url, False), answer(drawing_url, False)
    assert jumped == drawn and tokens == drawn_tokens
    jsonschema.validate(json.loads(jumped), SCHEMAS["nested objects"])
    (streamed, events), (streamed_drawn, drawn_events) = answer(url, True), answer(drawing_url, True)
    assert streamed == streamed_drawn == jumped
    assert events < drawn_events


def test_greedy_output_is_unchanged_beside_constrained_requests(url, client, model, hf_greedy):
    """Two long constrained streams are running (their first chunks came) while a greedy unconstrained request is
    answered: its tokens equal transformers' alone, and the loop's step records show the three in one batch."""
    since = requests.get(f"{url}/stats/timeline", timeout=10).json()["next"]["since"]
    regex = "[a-z ]{200,}"
    streams = [
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=300, stream=True, extra_body={"guided_regex": regex}
        )
        for _ in range(2)
    ]
    chunks = [iter(s) for s in streams]
    texts = [next(c).choices[0].text for c in chunks]
    plain = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].text == TOKENIZER.decode(hf_greedy(TOKENIZER.encode(PROMPT), 30))
    for i, c in enumerate(chunks):
        texts[i] += "".join(chunk.choices[0].text for chunk in c)
        assert re.fullmatch("[a-z ]*", texts[i]), texts[i]
    steps = requests.get(f"{url}/stats/timeline", params={"since": since}, timeout=10).json()["steps"]
    assert max(step["num_running"] for step in steps) == 3


@pytest.mark.parametrize("constraint", [{"guided_regex": "(.|\\n)*"}, {"guided_grammar": "start: /(.|\\n)*/"}])
def test_a_constraint_admitting_every_token_changes_nothing(client, model, constraint):
    args = dict(model=model, prompt=PROMPT, max_tokens=25, temperature=0)
    plain = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    constrained = client.completions.create(**args, extra_body={"ignore_eos": True, **constraint}).choices[0].text
    assert constrained == plain


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("completions", {"guided_json": {"type": "nope"}}, "guided_json"),
        ("completions", {"guided_json": "{broken"}, "guided_json"),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("completions", {"guided_choice": []}, "guided_choice"),
        ("completions", {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ("completions", {"guided_grammar": 'root ::= "a" | undefined'}, "guided_grammar"),
        ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ("completions", {"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
        ),
        ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
        (
            "chat",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field_and_the_server_keeps_serving(
    client, model, endpoint, fields, param
):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(model=model, prompt=PROMPT, max_tokens=5, extra_body=fields)
        else:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, extra_body=fields)
    assert caught.value.body["param"] == param
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].text is not None
