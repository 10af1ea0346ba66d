"""Chunked prefill: outputs equal transformers' at any token budget, and a long prompt never stalls decodes."""

import pytest
from conftest import random_prompts
from test_model import make_engine

from generate.sequence import SamplingParams, Sequence

BLOCK = 16  # budgets below cut prompts before, at and after block boundaries
BUDGETS = [7, 16, 33, 64]
LENGTHS = [1, 15, 16, 17, 40, 70, 100, 5]
NEW_TOKENS = [20, 12, 25, 9, 30, 14, 18, 40]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def run_in_waves(engine, prompts: list[list[int]], counts: list[int], check_every_step: bool = True) -> list[Sequence]:
    """Admit two prompts every few steps, so chunks share steps with running decodes; check the cache each step."""
    seqs = [Sequence(list(p), greedy(n)) for p, n in zip(prompts, counts)]
    pending = list(seqs)
    while pending or engine.has_work():
        for seq in pending[:2]:
            engine.add(seq)
        del pending[:2]
        for _ in range(3):
            engine.step()
            if check_every_step:
                engine.blocks.check_integrity(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0
    return seqs


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_output_equals_transformers_at_any_budget(tiny_checkpoint, hf_greedy, budget, prefix_cache):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=budget, prefix_cache=prefix_cache)
    prompts = random_prompts(LENGTHS, seed=21)
    seqs = run_in_waves(engine, prompts, NEW_TOKENS)
    assert [s.completion_ids for s in seqs] == [hf_greedy(p, n) for p, n in zip(prompts, NEW_TOKENS)]
    records = engine.step_log.since(0)
    chunked = [r for r in records if r.num_prefill_tokens]
    assert all(r.num_prefill_tokens + r.num_decodes <= budget for r in records)
    assert any(r.num_prefill_tokens + r.num_decodes == budget for r in chunked)  # a long prompt fills the budget
    # Prompts kept arriving while others decoded: most chunks shared their step with decodes.
    assert sum(r.num_decodes > 0 for r in chunked) >= len(chunked) // 2


@pytest.mark.parametrize("budget", BUDGETS)
def test_cached_prefix_then_chunks_that_do_not_start_on_a_block_boundary(tiny_checkpoint, hf_greedy, budget):
    (prefix,) = random_prompts([2 * BLOCK + 5], seed=22)  # two full blocks to share, and a partial one
    prompts = random_prompts([3, 30, 11, 60], seed=23, prefix=prefix)
    counts = [10, 22, 15, 8]
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=budget)
    first = run_in_waves(engine, prompts, counts)
    again = run_in_waves(engine, prompts, counts)  # every prompt now starts with cached blocks
    expected = [hf_greedy(p, n) for p, n in zip(prompts, counts)]
    assert [s.completion_ids for s in first] == [s.completion_ids for s in again] == expected
    assert all(s.num_shared_tokens >= 2 * BLOCK for s in again)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [7, 33])
def test_tiny_pool_preempts_without_changing_outputs(tiny_checkpoint, hf_greedy, budget, prefix_cache):
    # 20 blocks of 4 tokens; a 60-token prompt and its 16 new tokens need 19 of them.
    engine = make_engine(
        tiny_checkpoint, num_blocks=20, block_size=4, max_batch_tokens=budget, prefix_cache=prefix_cache
    )
    preempted_mid_prefill = []
    preempt = engine.scheduler._preempt

    def observed_preempt(seq):
        if 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
            preempted_mid_prefill.append(seq.seq_id)
        preempt(seq)

    engine.scheduler._preempt = observed_preempt
    prompts = random_prompts([10, 60, 10, 60, 10, 60], seed=24)
    counts = [16] * len(prompts)
    seqs = run_in_waves(engine, prompts, counts)
    assert [s.completion_ids for s in seqs] == [hf_greedy(p, n) for p, n in zip(prompts, counts)]
    assert engine.scheduler.num_preemptions >= 3
    # With 7 tokens a step a 60-token prompt is prefilled over 9 steps, and is the newest, so the
    # first to go when a decode needs a block: it is preempted part-way and later resumes.
    assert bool(preempted_mid_prefill) == (budget == 7)


def test_a_long_prompt_behind_many_decodes_gets_its_token_in_bounded_steps_and_never_stalls_them(tiny_checkpoint):
    budget, decoders = 40, 16
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=budget)
    running = [Sequence(p, greedy(200)) for p in random_prompts([5] * decoders, seed=25)]
    for seq in running:
        engine.add(seq)
    for _ in range(3):  # everyone admitted and decoding
        engine.step()
    assert all(len(s.completion_ids) > 0 for s in running)
    (long_prompt,) = random_prompts([600], seed=26)
    late = Sequence(long_prompt, greedy(5))
    engine.add(late)
    steps = 0
    while not late.completion_ids:
        before = [len(s.token_ids) for s in running]
        engine.step()
        steps += 1
        # every decode advanced by exactly one token in every step of the long prefill
        assert [len(s.token_ids) for s in running] == [n + 1 for n in before]
        assert engine.step_log.last.num_decodes == decoders
        assert engine.step_log.last.num_prefill_tokens <= budget - decoders
    assert steps == -(-600 // (budget - decoders))  # exactly the steps its chunks need, no more


def test_unchunked_prompts_wait_for_a_budget_that_holds_them_whole(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=1024, chunked_prefill=False)
    prompts = random_prompts(LENGTHS, seed=27)
    seqs = run_in_waves(engine, prompts, NEW_TOKENS)
    assert [s.completion_ids for s in seqs] == [hf_greedy(p, n) for p, n in zip(prompts, NEW_TOKENS)]
    # each prompt went through in one step: as many steps with prefill tokens as prompts computed
    assert sum(r.num_prefills for r in engine.step_log.since(0)) == len(prompts)
    with pytest.raises(ValueError, match="must cover one full context"):
        make_engine(tiny_checkpoint, max_batch_tokens=512, chunked_prefill=False)
