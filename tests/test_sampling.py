"""sample(): greedy, temperature, top-k and top-p per row, row isolation, and seeded sequences."""

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from generate.sampler import Sampler
from generate.sampling import SamplingRow, SamplingTensors, adjust_logits, sample
from generate.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")

# Probabilities 0.1, 0.2, 0.3, 0.4: the inverse CDF at temperature 1 is easy to read off.
QUARTER_LOGITS = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
# Distinct values in no particular order, so index order and probability order differ.
LOGITS_8 = [0.5, 2.0, -1.0, 1.5, 0.1, 1.8, -0.3, 1.0]


def draw(
    logits: list[float],
    uniform: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[int]:
    """Sample one row of logits once per uniform, all rows with the same settings."""
    rows = [SamplingRow(temperature, top_k, top_p, float(u)) for u in uniform]
    return sample_rows(torch.tensor([logits] * len(rows), dtype=torch.float32), rows).tolist()


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return sample(logits, SamplingTensors.build(rows, logits.shape[1], CPU))


def settings_rows(temperature, top_k, top_p, uniform) -> list[SamplingRow]:
    return [SamplingRow(float(t), int(k), float(p), float(u)) for t, k, p, u in zip(temperature, top_k, top_p, uniform)]


def uniforms(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def k_largest(logits: list[float], k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: logits[i], reverse=True)[:k])


def nucleus(logits: list[float], temperature: float, p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    weights = [math.exp(x / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: probs[i], reverse=True):
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            assert mass - p > 1e-3, "p too close to a boundary for a float32 test"
            return kept
    raise AssertionError("unreachable: the whole vocabulary has mass 1")


def test_inverse_cdf_at_temperature_one() -> None:
    # cumulative mass 0.1, 0.3, 0.6, 1.0
    u = torch.tensor([0.0, 0.05, 0.15, 0.29, 0.31, 0.59, 0.61, 0.99])
    assert draw(QUARTER_LOGITS, u) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_fixed_uniform_gives_the_same_token_every_time() -> None:
    u = uniforms(50, seed=3)
    first = draw(LOGITS_8, u, temperature=0.9, top_k=5, top_p=0.9)
    assert draw(LOGITS_8, u.clone(), temperature=0.9, top_k=5, top_p=0.9) == first


def test_top_k_renormalises_over_the_kept_tokens() -> None:
    # top-2 keeps 0.3 and 0.4: renormalised 3/7 ~ 0.4286 and 4/7
    u = torch.tensor([0.0, 0.42, 0.44, 0.99])
    assert draw(QUARTER_LOGITS, u, top_k=2) == [2, 2, 3, 3]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    u = torch.tensor([0.0, 0.42, 0.44, 0.99])
    assert draw(QUARTER_LOGITS, u, top_p=0.35) == [3, 3, 3, 3]  # 0.4 alone reaches 0.35
    assert draw(QUARTER_LOGITS, u, top_p=0.5) == [2, 2, 3, 3]  # 0.4 + 0.3 needed, as top-2 above


def test_greedy_rows_return_argmax_whatever_other_rows_do() -> None:
    logits = torch.tensor(
        [
            [0.1, 3.0, 0.2, 2.9],  # greedy, with sampling knobs that must be ignored
            [5.0, 0.0, 0.0, 0.0],  # sampled
            [0.0, 0.0, 1.0, 4.0],  # greedy
            [1.0, 1.0, 1.0, 1.0],  # sampled, top-1 of a tie is still a real token
        ]
    )
    temperature = torch.tensor([0.0, 1.5, 0.0, 0.7])
    top_k = torch.tensor([3, 2, 0, 1])
    top_p = torch.tensor([0.2, 0.6, 1.0, 0.3])
    for u in (0.0, 0.5, 0.999):
        out = sample_rows(logits, settings_rows(temperature, top_k, top_p, [u] * 4))
        assert out[0] == 1 and out[2] == 3


def test_greedy_row_is_argmax_even_when_the_top_two_nearly_tie() -> None:
    # A tiny temperature would still give the runner-up some mass here; greedy must not.
    logits = torch.tensor([[2.0, 2.00001, 0.0], [0.0, 1.0, 2.0]])
    temperature = torch.tensor([0.0, 1.0])
    for u in (0.0, 0.3):
        out = sample_rows(logits, settings_rows(temperature, [0, 0], [1, 1], [u, u]))
        assert out[0] == 1


def test_all_greedy_batch_returns_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, -1.0], [7.0, 2.0, 6.5]])
    out = sample_rows(logits, settings_rows([0, 0], [0, 0], [1, 1], [0.99, 0.99]))
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize(("k", "temperature"), [(1, 1.0), (3, 1.0), (3, 0.5), (5, 2.0), (8, 1.0)])
def test_top_k_samples_only_the_k_largest(k: int, temperature: float) -> None:
    tokens = draw(LOGITS_8, uniforms(2000, seed=k), temperature=temperature, top_k=k)
    assert set(tokens) == k_largest(LOGITS_8, k)  # never outside; with 2000 draws every one shows up


@pytest.mark.parametrize(("p", "temperature"), [(0.3, 1.0), (0.6, 1.0), (0.8, 1.0), (0.6, 0.5), (0.9, 2.0)])
def test_top_p_samples_only_the_nucleus(p: float, temperature: float) -> None:
    allowed = nucleus(LOGITS_8, temperature, p)
    assert len(allowed) < len(LOGITS_8)  # the filter does something in every case
    tokens = draw(LOGITS_8, uniforms(2000, seed=int(p * 10)), temperature=temperature, top_p=p)
    assert set(tokens) == allowed


def test_top_k_and_top_p_together() -> None:
    # top-4 by logit: 2.0, 1.8, 1.5, 1.0 -> nucleus of those renormalised probabilities
    top4 = sorted(k_largest(LOGITS_8, 4))
    sub = [LOGITS_8[i] for i in top4]
    allowed = {top4[i] for i in nucleus(sub, 1.0, 0.7)}
    assert allowed == k_largest(LOGITS_8, 3)  # by hand: 0.358, 0.293, 0.217, 0.132 -> 3 reach 0.7
    tokens = draw(LOGITS_8, uniforms(2000, seed=9), top_k=4, top_p=0.7)
    assert set(tokens) == allowed


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_argmax(temperature: float) -> None:
    tokens = draw(LOGITS_8, uniforms(2000, seed=1), temperature=temperature, top_k=1)
    assert set(tokens) == {1}  # 2.0 is the largest


def test_top_k_larger_than_the_vocabulary_keeps_everything() -> None:
    u = uniforms(500, seed=4)
    assert draw(LOGITS_8, u, top_k=100) == draw(LOGITS_8, u, top_k=0)


TARGETS = [  # (temperature, top_k, top_p) of the row under test
    (1.0, 0, 1.0),
    (0.8, 3, 1.0),
    (1.3, 0, 0.7),
    (0.6, 4, 0.8),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), TARGETS)
def test_a_row_is_sampled_the_same_alone_or_in_a_mixed_batch(temperature: float, top_k: int, top_p: float) -> None:
    n = 300
    u = uniforms(n, seed=11)
    alone = draw(LOGITS_8, u, temperature, top_k, top_p)

    # The same rows at even positions; between them rows with other logits and every other kind of setting.
    others = [(0.0, 2, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.2), (0.5, 6, 0.95), (1.0, 100, 1.0)]
    other_logits = torch.randn(n, len(LOGITS_8), generator=torch.Generator().manual_seed(5)) * 3
    logits, temps, ks, ps, us = [], [], [], [], []
    for i in range(n):
        t, k, p = others[i % len(others)]
        logits += [LOGITS_8, other_logits[i].tolist()]
        temps += [temperature, t]
        ks += [top_k, k]
        ps += [top_p, p]
        us += [float(u[i]), 1 - float(u[i])]
    mixed = sample_rows(torch.tensor(logits), settings_rows(temps, ks, ps, us))
    assert mixed[0::2].tolist() == alone
    assert len(set(alone)) > 1  # the comparison is not between constants


def test_plain_sampling_follows_softmax() -> None:
    logits = [1.0, 0.0, -0.5, 0.7, 0.2]
    weights = [math.exp(x) for x in logits]
    expected = [w / sum(weights) for w in weights]
    n = 20_000
    tokens = torch.tensor(draw(logits, uniforms(n, seed=2)))
    observed = torch.bincount(tokens, minlength=len(logits)).double() / n
    total_variation = 0.5 * sum(abs(o - e) for o, e in zip(observed.tolist(), expected))
    assert total_variation < 0.05


def test_temperature_sharpens_and_flattens() -> None:
    logits = [1.0, 0.0]
    n = 20_000
    for temperature in (0.5, 2.0):
        p0 = math.exp(1 / temperature) / (math.exp(1 / temperature) + 1)  # 0.881 and 0.622
        tokens = draw(logits, uniforms(n, seed=6), temperature=temperature)
        assert abs(tokens.count(0) / n - p0) < 0.02


@pytest.mark.parametrize(
    "u",
    [
        torch.tensor([1 - 1e-12], dtype=torch.float64),
        torch.tensor([torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()]),  # largest float32 < 1
        torch.tensor([1 - 1e-12]),  # rounds to 1.0 in float32
    ],
)
def test_uniform_next_to_one_never_picks_a_masked_token(u: torch.Tensor) -> None:
    # The kept tokens come first in index order, the masked ones after them.
    logits = [3.0, 2.5, -1.0, -2.0, -3.0, 0.5]
    assert draw(logits, u, top_k=2)[0] in {0, 1}
    assert draw(logits, u, top_p=0.5)[0] in nucleus(logits, 1.0, 0.5)
    assert draw(logits, u, top_k=1)[0] == 0
    assert draw(logits, u)[0] in range(len(logits))


def test_same_seed_same_stream_different_seed_different_stream() -> None:
    def stream(seed: int) -> list[float]:
        seq = Sequence([1, 2, 3], SamplingParams(seed=seed))
        return [seq.rng.random() for _ in range(8)]

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)
    reference = random.Random(7)
    assert stream(7) == [reference.random() for _ in range(8)]


# --- logit bias and penalties ------------------------------------------------------------

FIVE = [2.0, -1.0, 0.5, 3.0, -2.0]  # logits of a five-token vocabulary


def adjusted(rows: list[SamplingRow], logits: list[list[float]]) -> list[float]:
    """The rows' logits after bias and penalties, flattened."""
    return adjust_logits(torch.tensor(logits), SamplingTensors.build(rows, len(logits[0]), CPU)).flatten().tolist()


def test_penalties_equal_the_hand_computed_formula() -> None:
    # Generated so far: 3, 3, 1; prompt: 0. Repetition 2 divides positive and multiplies negative
    # logits of every token seen in prompt or output; then frequency 0.25 per occurrence and presence
    # 0.5 once, over the output only.
    row = SamplingRow(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, output_ids=(3, 3, 1), prompt_ids=(0,)
    )
    expected = [
        2.0 / 2,  # in the prompt only
        -1.0 * 2 - 0.25 * 1 - 0.5,  # generated once
        0.5,  # never seen
        3.0 / 2 - 0.25 * 2 - 0.5,  # generated twice
        -2.0,
    ]
    assert adjusted([row], [FIVE]) == pytest.approx(expected)


def test_presence_and_frequency_count_only_generated_tokens() -> None:
    row = SamplingRow(presence_penalty=1.0, frequency_penalty=1.0, output_ids=(2,), prompt_ids=(0, 1, 3))
    assert adjusted([row], [FIVE]) == pytest.approx([2.0, -1.0, 0.5 - 2, 3.0, -2.0])


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only() -> None:
    rows = [SamplingRow(logit_bias=((1, 5.0), (3, -100.0))), SamplingRow(), SamplingRow(logit_bias=((0, 0.5),))]
    expected = [2.0, 4.0, 0.5, -97.0, -2.0, *FIVE, 2.5, -1.0, 0.5, 3.0, -2.0]
    assert adjusted(rows, [FIVE] * 3) == pytest.approx(expected)


def test_bias_of_100_forces_a_token_and_minus_100_bans_one() -> None:
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(3)) * 5
    for temperature in (0.0, 1.0, 2.0):
        forced = [SamplingRow(temperature, uniform=float(u), logit_bias=((7, 100.0),)) for u in uniforms(200, seed=1)]
        assert set(sample_rows(logits, forced).tolist()) == {7}
        best = logits.argmax(dim=1).tolist()
        banned = [
            SamplingRow(temperature, uniform=float(u), logit_bias=((b, -100.0),)) for u, b in zip(uniforms(200), best)
        ]
        assert all(t != b for t, b in zip(sample_rows(logits, banned).tolist(), best))


def test_one_rows_penalties_and_bias_never_change_another_rows_token() -> None:
    n = 300
    logits = torch.randn(n, 8, generator=torch.Generator().manual_seed(8)) * 2
    plain = [SamplingRow(t, k, p, float(u)) for (t, k, p), u in zip(TARGETS * n, uniforms(n, seed=4))][:n]
    alone = sample_rows(logits, plain)
    # Every other row now has penalties, a bias and a history of its own; the plain rows' tokens stay.
    noisy = [
        row._replace(
            presence_penalty=1.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.7,
            logit_bias=((i % 8, 30.0),),
            output_ids=(1, 1, 2),
            prompt_ids=(5,),
        )
        if i % 2
        else row
        for i, row in enumerate(plain)
    ]
    mixed = sample_rows(logits, noisy)
    assert mixed[0::2].tolist() == alone[0::2].tolist()
    assert mixed[1::2].tolist() != alone[1::2].tolist()  # the penalised rows did change
    # And each penalised row is what it would be alone.
    for i in range(1, 20, 2):
        assert mixed[i] == sample_rows(logits[i : i + 1], [noisy[i]])[0]


def test_settings_decide_the_stages_on_the_host() -> None:
    plain = SamplingTensors.build([SamplingRow(temperature=0.0)] * 3, 10, CPU)
    assert plain.all_greedy and plain.k_max == 0
    assert plain.nucleus_rows is None and plain.bias is None and plain.penalties is None
    rows = [SamplingRow(top_k=4), SamplingRow(top_p=0.5, logit_bias=((2, 1.0),)), SamplingRow(presence_penalty=1.0)]
    some = SamplingTensors.build(rows, 10, CPU)
    assert not some.all_greedy and some.k_max == 4 and some.nucleus_rows.tolist() == [1]
    assert some.bias is not None and some.penalties is not None


class _SyncRecorder(TorchDispatchMode):
    """Records the ops that read a tensor's value back to the host (a GPU sync) or need its size."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "item", "is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.SYNCING):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sampling_reads_nothing_back_from_the_device_with_every_stage_on() -> None:
    rows = [
        SamplingRow(0.0),
        SamplingRow(0.8, top_k=3, uniform=0.3),
        SamplingRow(1.2, top_p=0.7, uniform=0.9, logit_bias=((1, 2.0),)),
        SamplingRow(1.0, uniform=0.5, presence_penalty=0.5, repetition_penalty=1.3, output_ids=(1, 2), prompt_ids=(3,)),
    ]
    settings = SamplingTensors.build(rows, 8, CPU)
    with _SyncRecorder() as recorder:
        sample(torch.tensor([LOGITS_8] * 4), settings)
    assert recorder.syncs == []


def test_a_steps_sampler_reads_back_only_the_tokens_when_no_logprobs_are_asked() -> None:
    seqs = [
        Sequence([1, 2, 3], SamplingParams(temperature=0)),
        Sequence([4, 5], SamplingParams(temperature=0.9, top_k=3, top_p=0.8, seed=1)),
        Sequence([6], SamplingParams(temperature=1.0, presence_penalty=1.0, logit_bias=((2, 3.0),), seed=2)),
    ]
    for seq in seqs:
        seq.num_scheduled_tokens = len(seq.token_ids)  # each samples its next token
    with _SyncRecorder() as recorder:
        tokens = Sampler(CPU)(seqs, torch.tensor([LOGITS_8] * 3))
    assert recorder.syncs == [] and tokens[0] == 1 and all(0 <= t < 8 for t in tokens)
