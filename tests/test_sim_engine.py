"""The real engine over SimRunner, on a fake clock: step times add up as the cost model says, tokens are exact."""

import pytest
from test_sim_cost import TINY_GPU, TINY_MODEL

from config import EngineSettings
from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence
from model.tokenizer import EOT_ID
from sim.engine import simulated_engine
from sim.profiles import ProfileError
from sim.runner import SimRunner
from sim.simulate import simulate


class FakeSleep:
    """Records the sleeps it is asked for instead of taking them."""

    def __init__(self):
        self.sleeps: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def tiny_step_s(seqs: list[tuple[int, int]]) -> float:
    """The tiny model's step time by hand: 784 weights per block, 2 blocks, vocab 100, d_model 8, 64 KV bytes/token."""
    flops = sum(2 * 2 * 784 * n + 2 * 100 * 8 + 4 * 2 * 8 * (n * c - n * (n - 1) // 2) for n, c in seqs)
    nbytes = 2 * 2376 + sum(64 * (c + n) for n, c in seqs)
    return 0.01 + flops / (1e6 * 0.5) + nbytes / (1e4 * 0.5)


def sim_engine(num_blocks: int = 256, block_size: int = 4, **settings) -> tuple[Engine, FakeSleep]:
    sleep = FakeSleep()
    runner = SimRunner(TINY_GPU, TINY_MODEL, sleep=sleep)
    return Engine(runner, num_blocks, EngineSettings(block_size=block_size, **settings), runner.name), sleep


GREEDY = SamplingParams(max_tokens=6, temperature=0)


def test_one_request_costs_one_prefill_and_n_minus_1_decodes():
    engine, clock = sim_engine()
    (completion,) = engine.generate([list(range(1, 11))], GREEDY)
    assert len(completion) == 6
    expected = [tiny_step_s([(10, 10)])] + [tiny_step_s([(1, c)]) for c in range(11, 16)]
    assert clock.sleeps == pytest.approx(expected)
    assert engine.runner.simulated_s == pytest.approx(sum(expected))
    assert simulate(TINY_GPU, TINY_MODEL, 10, 6, 1).total_s == pytest.approx(sum(expected))


def test_a_chunked_prompt_costs_each_chunk_at_its_own_context():
    engine, clock = sim_engine(max_batch_tokens=8)
    (completion,) = engine.generate([list(range(1, 31))], GREEDY)
    assert len(completion) == 6
    chunks = [tiny_step_s([(8, 8)]), tiny_step_s([(8, 16)]), tiny_step_s([(8, 24)]), tiny_step_s([(6, 30)])]
    assert clock.sleeps == pytest.approx(chunks + [tiny_step_s([(1, c)]) for c in range(31, 36)])
    # a decode beside a chunk: one step, both parts costed together
    engine.add(Sequence(list(range(1, 5)), SamplingParams(max_tokens=3, temperature=0)))
    engine.step()
    engine.add(Sequence(list(range(40, 60)), GREEDY))
    engine.step()
    assert clock.sleeps[-1] == pytest.approx(tiny_step_s([(1, 5), (7, 7)]))


def test_a_batch_of_four_costs_less_than_four_alone_and_what_simulate_predicts():
    prompts = [[7 * i + j for j in range(10)] for i in range(4)]
    alone, clock_alone = sim_engine()
    for prompt in prompts:
        alone.generate([prompt], GREEDY)
    together, clock_together = sim_engine()
    together.generate(prompts, GREEDY)
    assert len(clock_together.sleeps) == 6  # admitted together: one prefill step, five decode steps
    assert sum(clock_together.sleeps) < 0.5 * sum(clock_alone.sleeps)
    assert sum(clock_together.sleeps) == pytest.approx(simulate(TINY_GPU, TINY_MODEL, 10, 6, 4).total_s)


def test_tokens_are_deterministic_exact_in_length_and_never_end_of_text():
    prompts = [[5, 6, 7], [50255] * 9, [EOT_ID, 1]]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, stop_at_eos=True) for s in (1, 2, 3)]
    first = sim_engine()[0].generate(prompts, params)
    again = sim_engine()[0].generate(prompts, [SamplingParams(max_tokens=40, temperature=0)] * 3)
    assert first == again  # sampling settings and seeds change nothing
    assert all(len(c) == 40 and EOT_ID not in c and all(0 <= t < EOT_ID for t in c) for c in first)
    assert len(set(first[0])) > 30  # not one token repeated


def test_logprobs_are_zero_for_the_chosen_token():
    engine, _ = sim_engine()
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert [lp.logprob for lp in seq.logprobs] == [0.0] * 4
    assert [lp.top for lp in seq.logprobs] == [((t, 0.0),) for t in seq.completion_ids]


def test_memory_pressure_preempts_yet_every_request_completes():
    engine, clock = sim_engine(num_blocks=16, block_size=4)  # 64 tokens of cache for 6 x 22
    seqs = [Sequence([i + 1] * 10, SamplingParams(max_tokens=12, temperature=0)) for i in range(6)]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
        engine.blocks.check_integrity(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    assert engine.scheduler.num_preemptions > 0
    assert all(len(s.completion_ids) == 12 and s.finish_reason == "length" for s in seqs)
    assert engine.blocks.num_used_blocks == 0
    # Recomputed prefills cost time too: more than the six requests' own steps with no preemption.
    no_pressure, calm = sim_engine(num_blocks=256, block_size=4)
    no_pressure.generate([s.token_ids[:10] for s in seqs], SamplingParams(max_tokens=12, temperature=0))
    assert sum(clock.sleeps) > sum(calm.sleeps)


def test_from_settings_sizes_the_pool_and_names_the_simulation():
    engine = simulated_engine(EngineSettings(engine="sim", sim_model="llama-65b", sim_gpu="a100-80gb", sim_num_gpus=2))
    assert engine.model_name == "sim:llama-65b@2xa100-80gb"
    assert engine.max_context == 2048
    assert 500 < engine.blocks.num_blocks < 650
    assert engine.check_fits(2000, 48) is None
    assert "2048-token context" in engine.check_fits(2000, 49)
    assert simulated_engine(EngineSettings(engine="sim", sim_model="gpt2", sim_gpu="h100-sxm")).model_name == (
        "sim:gpt2@h100-sxm"
    )


def test_dtype_sets_the_simulated_precision():
    half = simulated_engine(EngineSettings(engine="sim", sim_model="gpt2", sim_gpu="a5000"))
    full = simulated_engine(EngineSettings(engine="sim", sim_model="gpt2", sim_gpu="a5000", dtype="float32"))
    assert (half.runner.model.bytes_per_param, full.runner.model.bytes_per_param) == (2, 4)
    # 24 GiB x 90% less the weights, over the KV bytes of a 16-token block
    assert half.blocks.num_blocks == int((0.9 * 24 * 2**30 - 124_439_808 * 2) // (16 * 2 * 12 * 768 * 2))
    assert full.blocks.num_blocks == int((0.9 * 24 * 2**30 - 124_439_808 * 4) // (16 * 2 * 12 * 768 * 4))


def test_from_settings_refuses_what_cannot_run():
    with pytest.raises(ProfileError, match="does not fit"):
        simulated_engine(EngineSettings(engine="sim", sim_model="llama-65b", sim_gpu="a100-80gb"))
    unchunked = r"MAX_BATCH_TOKENS \(1024\) must cover one full context \(2048 tokens\) when CHUNKED_PREFILL is off"
    with pytest.raises(ValueError, match=unchunked):
        simulated_engine(
            EngineSettings(engine="sim", sim_model="llama-7b", max_batch_tokens=1024, chunked_prefill=False)
        )
