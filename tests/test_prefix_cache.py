"""Prefix cache and memory pressure: outputs never change, blocks never leak, nobody starves."""

import pytest
from conftest import random_prompts
from test_model import make_engine

from generate.sequence import SamplingParams, Sequence

GREEDY = SamplingParams(max_tokens=24, temperature=0)
BLOCK = 4


def shared_prefix_prompts() -> list[list[int]]:
    (prefix,) = random_prompts([41], seed=7)  # 10 full blocks and one partial
    return random_prompts([1, 6, 13, 2, 9, 0, 21], seed=8, prefix=prefix)


def run_all(engine, prompts, together: bool) -> list[list[int]]:
    if together:
        return engine.generate(prompts, GREEDY)
    return [engine.generate([p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("together", [True, False])
def test_shared_prefix_outputs_equal_transformers(tiny_checkpoint, hf_greedy, prefix_cache, together):
    engine = make_engine(tiny_checkpoint, num_blocks=512, block_size=BLOCK, prefix_cache=prefix_cache)
    prompts = shared_prefix_prompts()
    assert run_all(engine, prompts, together) == [hf_greedy(p, GREEDY.max_tokens) for p in prompts]
    # A second round finds every prompt's prefix cached (or, with the cache off, nothing).
    assert run_all(engine, prompts, together) == [hf_greedy(p, GREEDY.max_tokens) for p in prompts]
    cached = engine.scheduler.prompt_tokens_cached
    assert cached >= 10 * BLOCK * len(prompts) if prefix_cache else cached == 0
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0


def test_fully_cached_prompt_still_computes_its_last_token(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint, num_blocks=512, block_size=BLOCK)
    (prompt,) = random_prompts([3 * BLOCK], seed=9)  # exactly three full blocks
    first = engine.generate([prompt], GREEDY)[0]
    again = Sequence(list(prompt), GREEDY)
    engine.add(again)
    engine.step()
    assert again.num_shared_tokens == 2 * BLOCK  # the last block is recomputed for its logits
    while engine.has_work():
        engine.step()
    assert first == again.completion_ids == hf_greedy(prompt, GREEDY.max_tokens)
    engine.blocks.check_integrity([])


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tiny_pool_evicts_and_preempts_without_changing_outputs(tiny_checkpoint, hf_greedy, prefix_cache):
    # 24 blocks of 4 tokens: the longest prompt (62 tokens) and its 24 new tokens need 22.
    engine = make_engine(tiny_checkpoint, num_blocks=24, block_size=BLOCK, prefix_cache=prefix_cache)
    prompts = shared_prefix_prompts()
    for _ in range(2):
        assert engine.generate(prompts, GREEDY) == [hf_greedy(p, GREEDY.max_tokens) for p in prompts]
        engine.blocks.check_integrity([])
    assert engine.scheduler.num_preemptions >= 5
    assert engine.blocks.evictions >= 10 if prefix_cache else engine.blocks.evictions == 0
    assert engine.blocks.num_used_blocks == 0


def test_integrity_holds_at_every_step_under_pressure(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=24, block_size=BLOCK)
    for prompt in shared_prefix_prompts():
        engine.add(Sequence(prompt, GREEDY))
    while engine.has_work():
        engine.step()
        live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        engine.blocks.check_integrity(live)
    assert engine.scheduler.num_preemptions > 0


def test_a_different_prompt_is_not_starved_by_a_stream_of_cache_hits(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=30, block_size=BLOCK)
    (prefix,) = random_prompts([40], seed=10)
    params = SamplingParams(max_tokens=16, temperature=0)
    stream = [Sequence(p, params) for p in random_prompts([3] * 200, seed=11, prefix=prefix)]
    (other,) = random_prompts([30], seed=12)
    c = Sequence(other, params)
    steps = 0
    for i, a in enumerate(stream):  # a new cache-hitting request every step
        engine.add(a)
        if i == 3:
            engine.add(c)
        engine.step()
        steps += 1
        if c.finish_reason:
            break
    # FCFS: C waits only for the few requests ahead of it (about 17 steps each here).
    assert c.finish_reason == "length" and steps <= 120
    assert not any(a.finish_reason for a in stream[4:steps])  # later arrivals did not overtake it
