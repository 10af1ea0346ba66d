"""Priorities at the engine's entry point: a more urgent request preempts less urgent running ones for seats
and for KV blocks, outputs stay transformers' greedy ones, nothing is lost, and aging keeps anyone from starving."""

import pytest
from conftest import random_prompts
from test_model import make_engine

from generate.priority import Rank
from generate.sequence import SamplingParams, Sequence

BLOCK = 4


def greedy(n: int, priority: int = 0, prompt: list[int] | None = None) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=n, temperature=0), priority=priority)


def step_checked(engine, steps: int = 1) -> None:
    for _ in range(steps):
        engine.step()
        engine.blocks.check_integrity(list(engine.scheduler.running) + list(engine.scheduler.waiting))


def drain(engine) -> None:
    while engine.has_work():
        step_checked(engine)
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("short_of", ["seats", "blocks"])
def test_an_urgent_request_preempts_a_running_batch_and_outputs_stay_greedy(tiny_checkpoint, hf_greedy, short_of):
    # seats: 4 seats, plenty of blocks. blocks: 64 seats, 16 blocks of 4 tokens, which the batch fills.
    limits = dict(max_batch_size=4) if short_of == "seats" else dict(num_blocks=16)
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=64, **limits)
    prompts = random_prompts([12, 9, 14, 11, 10], seed=40)
    batch = [greedy(30, 5, p) for p in prompts[:4]]
    for seq in batch:
        engine.add(seq)
    step_checked(engine, 3)
    assert all(s in engine.scheduler.running for s in batch) and all(s.num_generated for s in batch)
    assert engine.scheduler.num_preemptions == 0
    if short_of == "blocks":
        assert engine.blocks.num_free_blocks < engine.blocks.blocks_for(10)
    urgent = greedy(12, 0, prompts[4])
    engine.add(urgent)
    step_checked(engine)
    # admitted and prefilled in the very next step, its first token out, in place of the least urgent
    assert urgent.num_generated == 1 and urgent in engine.scheduler.running
    assert engine.scheduler.num_priority_preemptions >= 1 and batch[-1].num_preemptions == 1
    assert batch[0].num_preemptions == 0  # the earliest of the batch kept its place
    drain(engine)
    assert urgent.finish_reason == "length" and all(s.finish_reason == "length" for s in batch)
    seqs = batch + [urgent]
    assert [s.completion_ids for s in seqs] == [hf_greedy(p, s.params.max_tokens) for p, s in zip(prompts, seqs)]


def test_equal_priorities_keep_first_come_first_served_and_never_preempt_for_a_newcomer(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_size=2)
    first = [greedy(20, 3, p) for p in random_prompts([8, 8], seed=41)]
    for seq in first:
        engine.add(seq)
    step_checked(engine, 2)
    late = [greedy(5, 3, p) for p in random_prompts([8, 8], seed=42)]
    for seq in late:
        engine.add(seq)
    step_checked(engine, 5)
    assert engine.scheduler.num_preemptions == 0 and not any(s.num_generated for s in late)
    assert engine.scheduler.waiting == late  # in arrival order
    drain(engine)


def test_waiting_requests_are_admitted_in_priority_order_then_arrival(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_size=1)
    blocker = greedy(3, -10, random_prompts([5], seed=43)[0])
    engine.add(blocker)
    step_checked(engine)  # the blocker holds the one seat, and outranks everyone below
    queued = [greedy(2, p, q) for p, q in zip([2, 0, 1, 0, 2], random_prompts([5] * 5, seed=44))]
    for seq in queued:
        engine.add(seq)
    assert engine.scheduler.waiting == [queued[i] for i in (1, 3, 2, 0, 4)]
    order = []
    while engine.has_work():
        step_checked(engine)
        order += [s for s in queued if s.finish_reason and s not in order]
    assert order == [queued[i] for i in (1, 3, 2, 0, 4)]


def test_rank_ages_one_level_per_aging_period():
    aging = 10.0
    low, urgent = Rank.of(1, 100.0, 0, aging), Rank.of(0, 105.0, 1, aging)
    assert urgent < low  # 5 s of waiting is worth half a level
    assert Rank.of(1, 100.0, 0, aging) < Rank.of(0, 111.0, 1, aging)  # 11 s is worth more than one
    assert Rank.of(1, 100.0, 0, 0.0) > Rank.of(0, 10_000.0, 1, 0.0)  # strict: never
    assert Rank.of(0, 100.0, 0, aging) < Rank.of(0, 100.0, 1, aging)  # same instant: the order of adding


@pytest.mark.parametrize("aging_s", [0.0, 1e-9])
def test_aging_lets_a_low_priority_request_through_a_stream_of_urgent_ones(tiny_checkpoint, aging_s):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_size=2, priority_aging_s=aging_s)
    low = greedy(4, 1, random_prompts([6], seed=45)[0])
    engine.add(low)
    stream = [greedy(6, 0, p) for p in random_prompts([6] * 60, seed=46)]
    engine.add(stream[0])
    engine.add(stream[1])  # both seats taken by urgent ones before the first step
    steps = 0
    for seq in stream[2:]:  # a new urgent request every step
        engine.add(seq)
        step_checked(engine)
        steps += 1
        if low.finish_reason:
            break
    if aging_s:  # a nanosecond of waiting is worth a level: first come, first served
        assert low.finish_reason == "length" and steps < 15
    else:  # strict priority: urgent requests keep coming, and the low one never starts
        assert low.num_generated == 0
    for seq in engine.scheduler.running + engine.scheduler.waiting:
        engine.abort(seq)
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("prefill_first", [True, False])
def test_less_urgent_prompt_chunks_wait_while_an_urgent_prompt_prefills(tiny_checkpoint, hf_greedy, prefill_first):
    engine = make_engine(tiny_checkpoint, block_size=BLOCK, max_batch_tokens=16, priority_prefill_first=prefill_first)
    long_prompt, urgent_prompt, decoding_prompt = random_prompts([60, 20, 5], seed=47)
    decoding = greedy(30, 5, decoding_prompt)
    engine.add(decoding)
    step_checked(engine)  # decoding from now on
    batch = greedy(4, 5, long_prompt)
    engine.add(batch)
    step_checked(engine)  # its first chunk
    urgent = greedy(4, 0, urgent_prompt)
    engine.add(urgent)
    before = batch.num_computed_tokens
    step_checked(engine, 2)  # the urgent prompt's two chunks (15 and 5 tokens beside one decode)
    assert decoding.num_generated == 4  # decodes never wait
    if prefill_first:  # the batch's prompt waited two steps for the urgent one
        assert urgent.num_generated == 1 and batch.num_computed_tokens == before
    else:  # the batch's running prompt took the budget first: the urgent one is not even admitted
        assert urgent.num_generated == 0 and batch.num_computed_tokens == before + 30
    drain(engine)
    for seq, prompt in [(decoding, decoding_prompt), (batch, long_prompt), (urgent, urgent_prompt)]:
        assert seq.completion_ids == hf_greedy(prompt, seq.params.max_tokens)


def test_an_urgent_request_whose_cached_prefix_its_victim_holds_is_admitted_at_its_true_cost(
    tiny_checkpoint, hf_greedy
):
    """Preempting the sequence that holds the candidate's cached prefix puts those blocks back in the free queue,
    where admitting the candidate takes them as well: its cost is counted again after each preemption (counted
    once before, the admission ran out of blocks inside the step)."""
    engine = make_engine(tiny_checkpoint, block_size=2, num_blocks=10, max_batch_size=2, max_batch_tokens=64)
    held = [8, 7, 6, 5, 4, 3, 2, 1]
    batch = [greedy(4, 1, [1, 2, 3, 4, 5]), greedy(4, 1, held)]
    for seq in batch:
        engine.add(seq)
    step_checked(engine)
    urgent = greedy(2, 0, held + [9] * 8)  # its first 8 tokens are the running `held`'s cached blocks
    assert engine.blocks.admission_cost(urgent)[1] < len(urgent.token_ids)
    engine.add(urgent)
    step_checked(engine)
    assert urgent in engine.scheduler.running and engine.scheduler.num_priority_preemptions == 2
    drain(engine)
    seqs = [*batch, urgent]
    assert [s.completion_ids for s in seqs] == [
        hf_greedy(s.token_ids[: s.num_prompt_tokens], 4 if s.priority else 2) for s in seqs
    ]
