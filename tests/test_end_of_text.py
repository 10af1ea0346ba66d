"""`<|endoftext|>` in a text prompt is the end-of-text token (50256) on /v1/completions, /inference and
/tokenize, as in OpenAI's completions API and Hugging Face's GPT-2 tokenizer; in chat message content
it is text, as in OpenAI's chat API. Through HTTP on the shared real server.

lm-evaluation-harness's `local-completions` with `tokenized_requests=False` scores a corpus by rolling
log-likelihoods over documents joined by `<|endoftext|>`, sent as text with echo and logprobs; its
`hf` backend tokenizes the same text with the end-of-text token. The last test is that check without
the harness: the text prompt's log-probabilities equal the token-id prompt's and transformers'.
"""

import pytest
import requests
import torch

from model.tokenizer import EOT_ID, load_tokenizer

TOKENIZER = load_tokenizer()
EOT = "<|endoftext|>"
DOCUMENTS = ["The keeper lit the lamp.", " Ships passed the rocks at night.", "\nGulls cried over grey water."]


def text_tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, disallowed_special=())


def corpus_ids() -> list[int]:
    """The documents joined by the end-of-text token, as token ids (what the hf backend scores)."""
    ids = [EOT_ID]
    for document in DOCUMENTS:
        ids += text_tokens(document) + [EOT_ID]
    return ids


def post(url: str, path: str, body: dict) -> dict:
    response = requests.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_reads_it_as_one_token_in_a_prompt_and_as_text_in_a_message(url):
    assert post(url, "/tokenize", {"prompt": f"a{EOT}b"})["tokens"] == text_tokens("a") + [EOT_ID] + text_tokens("b")
    assert post(url, "/tokenize", {"prompt": EOT})["tokens"] == [EOT_ID]
    assert post(url, "/tokenize", {"prompt": "<|endofprompt|>"})["tokens"] == text_tokens("<|endofprompt|>")
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": f"a{EOT}b"}]})["tokens"]
    assert EOT_ID not in chat and len(text_tokens(EOT)) == 7  # the content's `<|endoftext|>` is its 7 text tokens


def test_inference_and_completions_read_it_as_the_token(url, hf_greedy):
    prompt = f"The keeper{EOT} Ships"
    ids = text_tokens("The keeper") + [EOT_ID] + text_tokens(" Ships")
    expected = hf_greedy(ids, 8)
    result = post(url, "/inference", {"prompt": prompt, "num_tokens": 8, "temperature": 0})
    assert result["token_ids"] == expected and result["prompt_tokens"] == len(ids)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    completion = post(url, "/v1/completions", body)
    assert completion["choices"][0]["text"] == TOKENIZER.decode(expected)
    assert completion["usage"]["prompt_tokens"] == len(ids)


def test_chat_content_keeps_it_as_text(url):
    messages = [{"role": "user", "content": f"Say {EOT} please"}]
    result = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
    tokenized = post(url, "/tokenize", {"messages": messages})["tokens"]
    assert result["usage"]["prompt_tokens"] == len(tokenized) and EOT_ID not in tokenized


def test_rolling_loglikelihood_of_a_text_corpus_equals_its_token_ids(url, hf_model):
    ids = corpus_ids()
    text = EOT + "".join(document + EOT for document in DOCUMENTS)
    body = {"max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    by_text = post(url, "/v1/completions", {**body, "prompt": text})["choices"][0]["logprobs"]
    by_ids = post(url, "/v1/completions", {**body, "prompt": ids})["choices"][0]["logprobs"]
    assert by_text["tokens"] == by_ids["tokens"] and by_text["tokens"].count(EOT) == len(DOCUMENTS) + 1
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1], dim=-1)  # [len - 1, V]
    expected = reference.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    # float32 log-probabilities of two requests (and of transformers): equal up to float32 rounding
    assert by_text["token_logprobs"][1:] == pytest.approx(by_ids["token_logprobs"][1:], rel=1e-5, abs=1e-5)
    assert by_text["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)
