import math
import statistics

import pytest

from client.data import PromptData, Sample, arrival_offsets


def test_same_seed_gives_identical_samples():
    assert PromptData(seed=3).samples(50) == PromptData(seed=3).samples(50)


def test_different_seeds_give_different_samples():
    assert PromptData(seed=0).samples(50) != PromptData(seed=1).samples(50)


def test_shorter_run_is_a_prefix_of_a_longer_one():
    assert PromptData(seed=5).samples(10) == PromptData(seed=5).samples(30)[:10]


def test_samples_are_named_tuples_with_text_prompts():
    samples = PromptData().samples(20)
    assert len(samples) == 20
    assert all(isinstance(s, Sample) and isinstance(s.prompt, str) and s.prompt for s in samples)


def test_prompts_vary_in_content_and_length():
    samples = PromptData().samples(500)
    word_counts = [len(s.prompt.split()) for s in samples]
    assert len({s.prompt for s in samples}) > 400
    assert 5 <= min(word_counts) <= 10
    assert 50 <= max(word_counts) <= 70


def test_num_tokens_are_clipped_to_bounds():
    # A spread far wider than the bounds puts many draws outside them, so clipping must hit both ends.
    tokens = [
        s.num_tokens for s in PromptData(mean_tokens=50, std_tokens=500, min_tokens=10, max_tokens=90).samples(500)
    ]
    assert min(tokens) == 10
    assert max(tokens) == 90
    assert all(isinstance(t, int) for t in tokens)


def test_num_tokens_follow_the_requested_mean():
    tokens = [s.num_tokens for s in PromptData(mean_tokens=100, std_tokens=10, max_tokens=1000).samples(2000)]
    assert statistics.mean(tokens) == pytest.approx(100, abs=2)


def test_zero_spread_gives_the_mean_rounded():
    assert {s.num_tokens for s in PromptData(mean_tokens=41.6, std_tokens=0).samples(10)} == {42}


@pytest.mark.parametrize("kwargs", [{"std_tokens": -1}, {"min_tokens": 0}, {"min_tokens": 20, "max_tokens": 10}])
def test_invalid_token_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        PromptData(**kwargs)


def test_arrivals_start_at_zero_and_never_go_back():
    offsets = arrival_offsets(200, rate=5.0, seed=0)
    assert len(offsets) == 200
    assert offsets[0] == 0.0
    assert all(a <= b for a, b in zip(offsets, offsets[1:]))


def test_arrival_gaps_average_one_over_rate():
    offsets = arrival_offsets(5001, rate=4.0, seed=1)
    mean_gap = offsets[-1] / 5000
    # The standard error of the mean of 5000 exponential gaps is 1.4% of the mean; 10% leaves a wide margin.
    assert mean_gap == pytest.approx(0.25, rel=0.1)


def test_arrivals_are_deterministic_per_seed():
    assert arrival_offsets(20, 2.0, seed=7) == arrival_offsets(20, 2.0, seed=7)
    assert arrival_offsets(20, 2.0, seed=7) != arrival_offsets(20, 2.0, seed=8)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(4, math.inf) == [0.0, 0.0, 0.0, 0.0]


def test_no_requests_no_arrivals():
    assert arrival_offsets(0, 1.0) == []


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_non_positive_rate_is_rejected(rate):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate)
