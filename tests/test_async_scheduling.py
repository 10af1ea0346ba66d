"""Asynchronous scheduling: a decode step launched behind the one before it, before that one's tokens are read.

Without a GPU the CUDA-graph runner's static buffers run eagerly (graphs="eager") with the Triton kernel
under its interpreter: the launch, the look-ahead and the bookkeeping are the same, only nothing overlaps.
"""

from itertools import groupby

import pytest
import torch
from conftest import random_prompts
from test_model import make_engine

pytest.importorskip("triton", reason="look-ahead steps replay the CUDA-graph runner, which runs the Triton kernel")

from generate.sequence import SamplingParams, Sequence, Status  # noqa: E402

GRAPHS = "capture" if torch.cuda.is_available() else "eager"


def engine_for(checkpoint, **settings):
    return make_engine(checkpoint, block_size=4, attention="triton", graphs=GRAPHS, **settings)


def greedy(prompt: list[int], n: int, **params) -> Sequence:
    return Sequence(list(prompt), SamplingParams(max_tokens=n, temperature=0, **params))


def launched_ahead(engine) -> int:
    """Steps launched before the step in front of them was read."""
    return engine.num_steps_ahead


def test_greedy_outputs_equal_transformers_with_steps_launched_ahead(tiny_checkpoint, hf_greedy):
    engine = engine_for(tiny_checkpoint, num_blocks=200)
    prompts = random_prompts([5, 9, 3, 12], seed=40)
    counts = [9, 4, 7, 2]  # they end at different steps, some while the step after theirs runs
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in counts])
    assert outputs == [hf_greedy(p, n) for p, n in zip(prompts, counts)]
    assert launched_ahead(engine) > 5
    assert engine.in_flight is None and not engine.has_work()
    engine.blocks.check_integrity([])


def test_seeded_samples_do_not_depend_on_it(tiny_checkpoint):
    """Each draw is keyed by the seed and the position it fills: a step launched ahead keys the position
    past the token still on its way, and min_tokens counts that token too. Off, nothing is launched ahead."""
    prompts = random_prompts([4, 7], seed=42)
    params = [
        SamplingParams(max_tokens=7, temperature=0.8, top_k=40, seed=6),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, stop_at_eos=True, min_tokens=4),
    ]
    outputs = {}
    for mode in ("auto", "off"):
        engine = engine_for(tiny_checkpoint, async_scheduling=mode)
        outputs[mode] = engine.generate(prompts, params)
        assert (launched_ahead(engine) > 0) == (mode == "auto")
    assert outputs["auto"] == outputs["off"]


def test_before_forward_is_called_in_each_launched_step_before_its_replay(tiny_checkpoint):
    """A step launched ahead calls Engine.before_forward too, once its inputs are in the graph's buffers. (Without
    a GPU the graph's replay runs the model's forward eagerly: a forward inside a replay is the same forward.)"""
    engine = engine_for(tiny_checkpoint)
    events: list[str] = []
    replay, forward = engine.runner.graphs.replay, engine.runner.model.forward
    engine.runner.graphs.replay = lambda n: events.append("forward") or replay(n)
    engine.runner.model.forward = lambda *args: events.append("forward") or forward(*args)
    engine.before_forward = lambda: events.append("inputs built")
    engine.generate(random_prompts([5, 9], seed=3), [SamplingParams(max_tokens=n, temperature=0) for n in (6, 8)])
    assert launched_ahead(engine) > 3
    assert [event for event, _ in groupby(events)] == ["inputs built", "forward"] * engine.num_steps


def test_an_abort_while_its_steps_are_in_flight_loses_nothing_else(tiny_checkpoint, hf_greedy):
    engine = engine_for(tiny_checkpoint)
    prompts = random_prompts([5, 8, 6], seed=43)
    seqs = [greedy(p, 8) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    deadline = 50
    while engine.in_flight is None or seqs[1] not in engine.in_flight.seqs:
        engine.step()
        deadline -= 1
        assert deadline, "no step was launched ahead"
    engine.abort(seqs[1])
    tokens_at_abort = list(seqs[1].token_ids)
    while engine.has_work():
        for result in engine.step():
            assert result.seq is not seqs[1], "an aborted sequence got a token"
    assert seqs[1].token_ids == tokens_at_abort and seqs[1].status is Status.FINISHED
    assert [s.completion_ids for s in (seqs[0], seqs[2])] == [hf_greedy(prompts[0], 8), hf_greedy(prompts[2], 8)]
    engine.blocks.check_integrity([])


def test_a_request_arriving_mid_flight_is_admitted_at_once(tiny_checkpoint, hf_greedy):
    """Nothing waits for the decoding batch to end: a free seat ends the look-ahead and the next step admits."""
    engine = engine_for(tiny_checkpoint)
    first, late = random_prompts([6, 9], seed=44)
    running = greedy(first, 12)
    engine.add(running)
    while launched_ahead(engine) < 2:
        engine.step()
    newcomer = greedy(late, 5)
    engine.add(newcomer)
    for _ in range(3):
        engine.step()
    assert newcomer.num_generated >= 1 and running.status is Status.RUNNING
    while engine.has_work():
        engine.step()
    assert [running.completion_ids, newcomer.completion_ids] == [hf_greedy(first, 12), hf_greedy(late, 5)]


def test_an_urgent_request_preempts_a_full_batch_launching_ahead(tiny_checkpoint, hf_greedy):
    engine = engine_for(tiny_checkpoint, max_batch_size=2, priority_aging_s=0)  # strict: the test runs slowly
    a, b, c = random_prompts([5, 6, 7], seed=45)
    batch = [greedy(a, 14), greedy(b, 14)]
    for seq in batch:
        engine.add(seq)
    while launched_ahead(engine) < 2:
        engine.step()
    urgent = Sequence(list(c), SamplingParams(max_tokens=4, temperature=0), priority=-1)
    engine.add(urgent)
    steps = 0
    while urgent.status is not Status.FINISHED:
        engine.step()
        steps += 1
    assert steps <= 8, "the urgent request waited for the batch"
    assert batch[1].num_preemptions == 1 and batch[1].status is not Status.FINISHED
    while engine.has_work():
        engine.step()
    assert [s.completion_ids for s in [*batch, urgent]] == [hf_greedy(a, 14), hf_greedy(b, 14), hf_greedy(c, 4)]


def test_the_setting_takes_auto_or_off(monkeypatch):
    from config import EngineSettings

    assert EngineSettings().async_scheduling == "auto"
    monkeypatch.setenv("ASYNC_SCHEDULING", "off")
    assert EngineSettings.from_env().async_scheduling == "off"
    with pytest.raises(ValueError, match="ASYNC_SCHEDULING must be auto or off, got 'on'"):
        EngineSettings(async_scheduling="on")
