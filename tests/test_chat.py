"""/v1/chat/completions through the official openai client, and the chat template."""

import json

import openai
import pytest
import torch

from api.chat_template import ChatTemplate
from app import create_app
from config import Settings
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
MESSAGES = [
    {"role": "system", "content": "You keep a lighthouse."},
    {"role": "user", "content": "What did you see tonight?"},
    {"role": "assistant", "content": "Ships."},
    {"role": "user", "content": [{"type": "text", "text": "How many"}, {"type": "text", "text": "ships?"}]},
]
TRANSCRIPT = (
    "You keep a lighthouse.\n\nUser: What did you see tonight?\nAssistant: Ships.\nUser: How many\nships?\nAssistant:"
)


def chat(client, model, **kwargs):
    kwargs.setdefault("extra_body", {})["ignore_eos"] = True
    return client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)


def reply_of(ids: list[int], stops=("\nUser:", "\nAssistant:")) -> str:
    """The text of generated ids, cut where the model starts another turn."""
    text = TOKENIZER.decode(ids)
    return text[: min([text.find(s) for s in stops if s in text], default=len(text))]


def test_the_default_template_makes_a_transcript():
    messages = [(m["role"], m["content"] if isinstance(m["content"], str) else "") for m in MESSAGES[:3]]
    assert ChatTemplate.load().render([*messages, ("developer", "Be brief.")]) == (
        "You keep a lighthouse.\n\nUser: What did you see tonight?\nAssistant: Ships.\nBe brief.\n\nAssistant:"
    )


def test_greedy_reply_equals_transformers_on_the_transcript(client, model, hf_greedy):
    result = chat(client, model, max_completion_tokens=12, temperature=0)
    (choice,) = result.choices
    expected = hf_greedy(TOKENIZER.encode(TRANSCRIPT), 12)
    assert choice.message.role == "assistant" and choice.message.content == reply_of(expected)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.usage.prompt_tokens == len(TOKENIZER.encode(TRANSCRIPT))


@pytest.mark.parametrize("interval", [None, 3])  # vLLM's stream_interval: the same reply in fewer events
def test_streamed_reply_joins_to_the_whole_one(client, model, interval):
    args = dict(max_tokens=20, temperature=0.9, seed=4, n=2, stream_options={"include_usage": True})
    whole = chat(client, model, **{k: v for k, v in args.items() if k != "stream_options"})
    extra = {"extra_body": {"stream_interval": interval}} if interval else {}
    chunks = list(chat(client, model, stream=True, **args, **extra))
    *events, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c.choices[0] for c in events if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
        assert [c.finish_reason for c in mine][-1] == whole.choices[i].finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])


def test_n_seeded_replies_are_reproducible_and_differ(client, model):
    first, again = ([c.message.content for c in chat(client, model, n=3, max_tokens=15, seed=9).choices] for _ in "ab")
    assert first == again and len(set(first)) == 3


def test_logprobs_and_top_logprobs_equal_transformers(client, model, hf_model):
    result = chat(client, model, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body={})
    content = result.choices[0].logprobs.content
    prompt = TOKENIZER.encode(TRANSCRIPT)
    generated = TOKENIZER.encode("".join(e.token for e in content))
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt + generated])).logits[0], dim=-1)
    for i, entry in enumerate(content):
        row = reference[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(row.max().item(), abs=1e-3)  # greedy: the likeliest
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-3)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_stop_strings_and_max_tokens(client, model):
    full = chat(client, model, max_tokens=30, temperature=0).choices[0]
    stop = full.message.content[8:11]
    cut = chat(client, model, max_tokens=30, temperature=0, stop=[stop]).choices[0]
    assert cut.message.content == full.message.content[: full.message.content.index(stop)]
    assert cut.finish_reason == "stop"
    assert chat(client, model, max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"max_tokens": 2000}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"seed": -1}, "seed"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "extra_body": {"stream_interval": 0}}, "stream_interval"),
    ],
)
def test_bad_requests_raise_bad_request_error_naming_the_field(client, model, kwargs, param):
    kwargs = {"model": model, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.body["param"] == param


def test_a_model_not_served_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


# --- a template of one's own (CHAT_TEMPLATE) -----------------------------------------------


def test_the_reply_ends_at_the_templates_next_turn_marker(tiny_checkpoint, tmp_path, hf_greedy):
    transcript = "Q: what now\nA:"
    ongoing = TOKENIZER.decode(hf_greedy(TOKENIZER.encode(transcript), 20))
    marker = ongoing[6:9]  # make the greedy reply "start a new turn" part-way through
    template = tmp_path / "qa.toml"
    template.write_text(
        'system = "{content}\\n"\nuser = "Q: {content}\\n"\nassistant = "A: {content}\\n"\n'
        f'reply = "A:"\nstop = [{json.dumps(marker)}]\n'
    )
    app = create_app(Settings.of(model=str(tiny_checkpoint), kv_cache_blocks=256, chat_template=str(template)))
    body = {
        "messages": [{"role": "user", "content": "what now"}],
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = app.test_client().post("/v1/chat/completions", json=body).get_json()["choices"][0]
    assert reply["message"]["content"] == ongoing[: ongoing.index(marker)] and reply["finish_reason"] == "stop"
    app.extensions["server"].manager.shut_down(0)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('user = "U: {content}"', "needs exactly the keys"),
        ('system = "{content}"\nuser = "U:"\nassistant = "{content}"\nreply = "A:"\nstop = []', "one '{content}'"),
        ('system = "{content}"\nuser = "{content}"\nassistant = "{content}"\nreply = "A:"\nstop = [""]', "'stop'"),
        ("not toml = = =", "CHAT_TEMPLATE"),
    ],
)
def test_a_broken_template_file_is_refused_with_its_problem(tmp_path, text, problem):
    path = tmp_path / "template.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        ChatTemplate.load(str(path))
