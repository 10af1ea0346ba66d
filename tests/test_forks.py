"""n completions of one prompt: the prompt computed once (forks share its blocks), outputs unchanged,
blocks accounted for at every step, under preemption, an aborted leader and tiny budgets."""

import pytest
from conftest import random_prompts
from test_model import make_engine, run_checked

from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence

BLOCK = 4


def group(prompt: list[int], params: list[SamplingParams]) -> list[Sequence]:
    """A leader and its forks, as the API builds n completions of one prompt."""
    leader = Sequence(list(prompt), params[0])
    return [leader] + [Sequence(list(prompt), p, fork_of=leader) for p in params[1:]]


def prefill_tokens(engine: Engine) -> int:
    return sum(record.num_prefill_tokens for record in engine.step_log.since(0))


def tail(prompt_len: int) -> int:
    """Tokens a fork computes itself: those after the full blocks before the prompt's last token."""
    return prompt_len - (prompt_len - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [7, 256])
@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(41, 12), (40, 12), (43, 1)])
def test_n_greedy_completions_compute_the_prompt_once(
    tiny_checkpoint, hf_greedy, prefix_cache, budget, prompt_len, max_tokens
):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, prefix_cache=prefix_cache, max_batch_tokens=budget)
    (prompt,) = random_prompts([prompt_len], seed=prompt_len)
    seqs = group(prompt, [SamplingParams(max_tokens=max_tokens, temperature=0)] * 4)
    run_checked(engine, seqs)
    assert prefill_tokens(engine) == prompt_len + 3 * tail(prompt_len)  # not 4 * prompt_len
    assert all(s.completion_ids == hf_greedy(prompt, max_tokens) for s in seqs)


def test_seeded_forks_are_what_their_seeds_give_alone_and_differ(tiny_checkpoint):
    (prompt,) = random_prompts([30], seed=3)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=s) for s in (5, 6, 7, 8)]
    forked = make_engine(tiny_checkpoint, block_size=BLOCK, prefix_cache=False)
    seqs = group(prompt, params)
    run_checked(forked, seqs)
    alone = make_engine(tiny_checkpoint, block_size=BLOCK, prefix_cache=False).generate([prompt] * 4, params)
    assert [s.completion_ids for s in seqs] == alone  # sharing the prompt changes no token
    assert len({tuple(c) for c in alone}) == 4


def test_forks_preempted_for_memory_recompute_their_prompt_correctly(tiny_checkpoint, hf_greedy):
    # 20 blocks of 4 tokens; two prompts of 30 with 4 completions of 16 tokens each cannot all run.
    engine = make_engine(tiny_checkpoint, num_blocks=20, block_size=BLOCK)
    prompts = random_prompts([30, 30], seed=11)
    params = [SamplingParams(max_tokens=16, temperature=0)] * 4
    seqs = group(prompts[0], params) + group(prompts[1], params)
    run_checked(engine, seqs)
    assert any(s.num_preemptions for s in seqs[1:4] + seqs[5:])  # forks were preempted
    for seq, prompt in zip(seqs, [prompts[0]] * 4 + [prompts[1]] * 4):
        assert seq.completion_ids == hf_greedy(prompt, 16)


def test_forks_of_an_aborted_leader_compute_their_prompt_themselves(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=7)
    (prompt,) = random_prompts([29], seed=4)
    leader, *forks = group(prompt, [SamplingParams(max_tokens=8, temperature=0)] * 3)
    for seq in (leader, *forks):
        engine.add(seq)
    engine.step()  # the leader's first chunk: its forks are admitted and wait for it
    assert all(f.fork_of is leader for f in forks) and len(engine.scheduler.running) == 3
    engine.abort(leader)
    run_checked(engine, [])
    assert all(f.completion_ids == hf_greedy(prompt, 8) for f in forks)
    assert leader.completion_ids == []


def test_more_forks_than_a_step_can_hold_still_all_finish(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=2)  # two sequences per step
    (prompt,) = random_prompts([13], seed=6)
    seqs = group(prompt, [SamplingParams(max_tokens=5, temperature=0)] * 5)
    run_checked(engine, seqs)
    assert all(s.completion_ids == hf_greedy(prompt, 5) for s in seqs)


def test_forks_have_their_prompts_logprobs_too(tiny_checkpoint, hf_prompt_logprobs):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=7)
    (prompt,) = random_prompts([26], seed=8)
    seqs = group(prompt, [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)] * 3)
    run_checked(engine, seqs)
    expected, _ = hf_prompt_logprobs(prompt)
    for seq in seqs:
        assert [e.logprob for e in seq.prompt_logprobs] == pytest.approx(expected, abs=1e-3)
    assert prefill_tokens(engine) == 26 + 2 * tail(26)


def test_forks_and_prompt_logprobs_through_the_paged_kernel_and_decode_graphs(
    tiny_checkpoint, hf_greedy, hf_prompt_logprobs
):
    # The Triton kernel (under its interpreter on CPU) and the graph runner's static buffers (capture off).
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, attention="triton", graphs="eager", max_batch_tokens=9)
    (prompt,) = random_prompts([22], seed=12)
    seqs = group(prompt, [SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0)] * 3)
    run_checked(engine, seqs)
    expected, _ = hf_prompt_logprobs(prompt)
    for seq in seqs:
        assert seq.completion_ids == hf_greedy(prompt, 6)
        assert [e.logprob for e in seq.prompt_logprobs] == pytest.approx(expected, abs=1e-3)
    assert engine.runner.graphs.num_replays > 0 and prefill_tokens(engine) == 22 + 2 * tail(22)
