"""Prompt log-probabilities (what echo returns): transformers' log-softmax, whatever the chunk budget,
with the prefix cache on (after the same prompts were cached) and off, and under preemption."""

import pytest
from conftest import random_prompts
from test_model import make_engine, run_checked

from generate.sequence import SamplingParams, Sequence

BLOCK = 4
TOP = 3


def prompts() -> list[list[int]]:
    (prefix,) = random_prompts([23], seed=21)
    return random_prompts([1, 9, 17, 0], seed=22, prefix=prefix) + random_prompts([2, 31], seed=23)


def assert_equal_to_transformers(seq: Sequence, reference) -> None:
    expected, top_ids = reference(seq.token_ids[: seq.num_prompt_tokens], TOP)
    assert len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1
    assert [e.logprob for e in seq.prompt_logprobs] == pytest.approx(expected, abs=1e-3)
    assert [[t for t, _ in e.top] for e in seq.prompt_logprobs] == top_ids


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [7, 16, 256])
def test_prompt_logprobs_equal_transformers_after_the_prompts_were_cached(
    tiny_checkpoint, hf_prompt_logprobs, hf_greedy, prefix_cache, budget
):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, prefix_cache=prefix_cache, max_batch_tokens=budget)
    engine.generate(prompts(), SamplingParams(max_tokens=2, temperature=0))  # cache the same prompts first
    to_compute = [engine.blocks.admission_cost(Sequence(p))[1] for p in prompts()]  # without prompt logprobs
    assert (sum(to_compute) < sum(len(p) for p in prompts())) == prefix_cache
    lengths = [0, 1, 5, 0, 3, 2]  # max_tokens 0: the prompt only
    seqs = [
        Sequence(p, SamplingParams(max_tokens=n, temperature=0, prompt_logprobs=TOP))
        for p, n in zip(prompts(), lengths)
    ]
    run_checked(engine, seqs)
    for seq, n in zip(seqs, lengths):
        assert_equal_to_transformers(seq, hf_prompt_logprobs)
        assert seq.num_shared_tokens == 0  # computed, not read from the cache
        assert seq.completion_ids == (hf_greedy(seq.token_ids[: seq.num_prompt_tokens], n) if n else [])
        assert seq.finish_reason == "length"


def test_prompt_logprob_requests_still_fill_the_cache_for_others(tiny_checkpoint):
    # Prompts that share nothing: blocks after a prefix that is cached already are not cached again
    # (the trie keeps the first copy of a prefix), as for any two sequences computing one prefix at once.
    engine = make_engine(tiny_checkpoint, block_size=BLOCK)
    distinct = random_prompts([24, 31, 9, 40], seed=41)
    for prompt in distinct:
        run_checked(engine, [Sequence(list(prompt), SamplingParams(max_tokens=1, prompt_logprobs=0))])
    for prompt in distinct:
        plain = Sequence(list(prompt), SamplingParams(max_tokens=1))
        run_checked(engine, [plain])
        assert plain.num_shared_tokens == (len(prompt) - 1) // BLOCK * BLOCK


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny_checkpoint, hf_prompt_logprobs):
    # 16 blocks of 4 and a budget of 7: long prompts are preempted part-way through and recomputed.
    engine = make_engine(tiny_checkpoint, num_blocks=16, block_size=BLOCK, max_batch_tokens=7)
    long_prompts = random_prompts([25, 27, 30], seed=31)
    seqs = [Sequence(p, SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=TOP)) for p in long_prompts]
    run_checked(engine, seqs)
    assert engine.scheduler.num_preemptions > 0
    for seq in seqs:
        assert_equal_to_transformers(seq, hf_prompt_logprobs)


def test_a_prompt_only_sequence_generates_nothing_and_frees_its_blocks(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=5)
    seq = Sequence(random_prompts([18], seed=2)[0], SamplingParams(max_tokens=0, prompt_logprobs=0))
    run_checked(engine, [seq])
    assert seq.completion_ids == [] and seq.finish_reason == "length" and len(seq.prompt_logprobs) == 17
    assert all(e.top == () for e in seq.prompt_logprobs)
    assert engine.blocks.num_used_blocks == 0
