"""The engine without the server (generate/llm.py) and example.py: greedy outputs of a batch equal
transformers' one prompt at a time, finish reasons, log-probabilities against transformers' log-softmax."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, random_prompts

from generate.llm import LLM, SamplingParams
from model.tokenizer import EOT_ID, load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # a token budget smaller than the longest prompt: it is prefilled in chunks beside the others' decodes
    return LLM(str(tiny_checkpoint), dtype="float32", kv_cache_blocks=256, max_batch_tokens=64)


def test_greedy_outputs_of_a_batch_equal_transformers(llm, hf_greedy):
    prompts = random_prompts([5, 17, 90, 33, 1, 64], seed=3)
    steps_before = llm.engine.num_steps
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        (completion,) = output.outputs
        assert completion.token_ids == hf_greedy(prompt, 12)
        assert completion.finish_reason == "length"
    # batched: six prompts of 12 tokens each took far fewer steps than one at a time would (6 x 12)
    assert llm.engine.num_steps - steps_before < 6 * 12 / 2


def test_a_text_prompt_is_tokenized_and_its_completion_decoded(llm, hf_greedy):
    tokenizer = load_tokenizer()
    (output,) = llm.generate("The lighthouse keeper", GREEDY)
    assert output.prompt == "The lighthouse keeper"
    assert output.prompt_token_ids == tokenizer.encode("The lighthouse keeper")
    completion = output.outputs[0]
    assert completion.token_ids == hf_greedy(output.prompt_token_ids, 12)
    assert completion.text == tokenizer.decode(completion.token_ids)


def test_finish_reasons(llm):
    """End-of-text ends a completion only with stop_at_eos (as /inference), then as "stop" and without text."""
    force_eot = ((EOT_ID, 100.0),)
    stop, length = llm.generate(
        [[464, 46371], [464, 46371]],
        [
            SamplingParams(temperature=0, max_tokens=5, stop_at_eos=True, logit_bias=force_eot),
            SamplingParams(temperature=0, max_tokens=5, logit_bias=force_eot),
        ],
    )
    assert stop.outputs[0].finish_reason == "stop"
    assert stop.outputs[0].token_ids == [EOT_ID]
    assert stop.outputs[0].text == ""
    assert length.outputs[0].finish_reason == "length"
    assert length.outputs[0].token_ids == [EOT_ID] * 5


def test_logprobs_are_transformers_log_softmax(llm, hf_model, hf_prompt_logprobs):
    (prompt,) = random_prompts([20], seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=1)
    (output,) = llm.generate([prompt], params)
    completion = output.outputs[0]
    ids = prompt + completion.token_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(completion.logprobs) == 6
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = logprobs[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        top_values, top_ids = row.topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert token == entry.top[0][0]  # greedy: the chosen token is the likeliest
    expected, _ = hf_prompt_logprobs(prompt)
    assert [e.logprob for e in output.prompt_logprobs] == pytest.approx(expected, abs=1e-4)


def test_prompts_that_cannot_run_are_refused_before_any_step(llm):
    steps = llm.engine.num_steps
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[50257]], GREEDY)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 1020], GREEDY)
    assert llm.engine.num_steps == steps and not llm.engine.has_work()


def test_example_runs(tiny_checkpoint):
    example = ROOT / "example.py"
    assert len(example.read_text().splitlines()) <= 20
    env = {**os.environ, "MODEL": str(tiny_checkpoint)}
    run = subprocess.run([sys.executable, str(example)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and all(" -> " in line and " tokens, " in line for line in lines)
