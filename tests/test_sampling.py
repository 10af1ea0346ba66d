"""sample(): greedy, temperature, top-k and top-p per row, row isolation, the draw's distribution,
and its noise: a pure function of (seed, position, token) that a last-bit change of the logits
does not move."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from generate.noise import id_hashes, log_uniforms, row_key
from generate.race import exponential_race
from generate.sampler import Sampler
from generate.sampling_ops import SamplingRow, SamplingTensors, adjust_logits, sample
from generate.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")

# Probabilities 0.1, 0.2, 0.3, 0.4.
QUARTER_LOGITS = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
# Distinct values in no particular order, so index order and probability order differ.
LOGITS_8 = [0.5, 2.0, -1.0, 1.5, 0.1, 1.8, -0.3, 1.0]


def draw(
    logits: list[float],
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[int]:
    """n draws from one row of logits: the positions 0..n-1 of one seed, all with the same settings."""
    rows = [SamplingRow(temperature, top_k, top_p, seed, position) for position in range(n)]
    return sample_rows(torch.tensor([logits] * n, dtype=torch.float32), rows).tolist()


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return sample(logits, SamplingTensors.build(rows, logits.shape[1], CPU))


def settings_rows(temperature, top_k, top_p, seeds) -> list[SamplingRow]:
    return [SamplingRow(float(t), int(k), float(p), int(s)) for t, k, p, s in zip(temperature, top_k, top_p, seeds)]


def k_largest(logits: list[float], k: int) -> set[int]:
    return set(sorted(range(len(logits)), key=lambda i: logits[i], reverse=True)[:k])


def softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    weights = [math.exp(x / temperature) for x in logits]
    return [w / sum(weights) for w in weights]


def nucleus(logits: list[float], temperature: float, p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    probs = softmax(logits, temperature)
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: probs[i], reverse=True):
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            assert mass - p > 1e-3, "p too close to a boundary for a float32 test"
            return kept
    raise AssertionError("unreachable: the whole vocabulary has mass 1")


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution the settings define, computed from their definitions in float64."""
    kept = k_largest(logits, top_k) if top_k else set(range(len(logits)))
    probs = softmax([x if i in kept else -math.inf for i, x in enumerate(logits)], temperature)
    if top_p < 1:
        kept = nucleus([x if i in kept else -math.inf for i, x in enumerate(logits)], temperature, top_p)
        probs = [q if i in kept else 0.0 for i, q in enumerate(probs)]
    return [q / sum(probs) for q in probs]


def chi_square_p_value(tokens: list[int], probs: list[float]) -> float:
    """Pearson's test of the draws against probs (over the tokens of non-zero probability): the chance of a
    statistic this large if the draws follow probs. No draw may fall on a token of zero probability."""
    assert all(probs[t] > 0 for t in tokens), "a token of zero probability was drawn"
    support = [i for i, q in enumerate(probs) if q > 0]
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = torch.tensor([probs[i] for i in support], dtype=torch.float64) * len(tokens)
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    degrees = torch.tensor(len(support) - 1, dtype=torch.float64)
    return torch.special.gammaincc(degrees / 2, statistic / 2).item()  # the chi-square survival function


SETTINGS = [  # (temperature, top_k, top_p): each stage alone and together
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (2.0, 0, 1.0),
    (1.0, 3, 1.0),
    (0.7, 5, 1.0),
    (1.0, 0, 0.8),
    (1.5, 0, 0.6),
    (1.0, 4, 0.7),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_draws_follow_the_distribution_the_settings_define(temperature: float, top_k: int, top_p: float) -> None:
    # 20,000 draws of 8 tokens: a wrong temperature, a token too many or too few, or an inverse-CDF style
    # off-by-one moves the statistic far beyond 1e-6 (a true sampler fails one seed in a million: the
    # seeds are fixed, so this one's result is the same on every run).
    probs = expected_distribution(LOGITS_8, temperature, top_k, top_p)
    tokens = draw(LOGITS_8, 20_000, temperature, top_k, top_p, seed=17)
    assert chi_square_p_value(tokens, probs) > 1e-6
    assert {t for t, q in enumerate(probs) if q > 0} == set(tokens)  # every kept token shows up, and only those


@pytest.mark.parametrize(
    ("vocab", "heavy"),
    [
        (11, {0: 1.0, 2: 0.5, 9: 2.0, 10: 1.5}),  # groups of 3: the last, of 2, ends on token 10
        (50257, {0: 1.0, 223: 0.3, 224: 0.6, 40_000: 1.2, 50_175: 0.8, 50_176: 0.9, 50_256: 1.5}),
    ],
)
def test_the_race_in_groups_draws_each_token_by_its_weight(vocab: int, heavy: dict[int, float]) -> None:
    # The two-round race over groups of isqrt(V) tokens, a short last group among them: tokens at the
    # groups' edges and in the last group (its last token entered more than once) are drawn by weight.
    # The other tokens share 5 % of the mass, so a group's weight being miscounted shows too.
    rest = 0.05 * sum(heavy.values()) / (vocab - len(heavy))
    weights = torch.full((vocab,), rest, dtype=torch.float64)
    for token, weight in heavy.items():
        weights[token] = weight
    probs = (weights / weights.sum()).tolist()
    lumped = [sum(p for i, p in enumerate(probs) if i not in heavy)]  # the light tokens as one outcome
    n = 20_000
    keys = torch.tensor([row_key(9, position) for position in range(n)], dtype=torch.int32)
    drawn = exponential_race(weights.float().expand(n, -1).contiguous(), keys).tolist()
    outcome = {token: i for i, token in enumerate(heavy)}
    tokens = [outcome.get(t, len(heavy)) for t in drawn]
    assert chi_square_p_value(tokens, [probs[t] for t in heavy] + lumped) > 1e-6


def test_the_chi_square_check_rejects_a_sampler_that_is_slightly_off() -> None:
    # The planted error: the temperature 10 % off. The same draws, tested against the true distribution.
    tokens = draw(LOGITS_8, 20_000, temperature=1.1, seed=17)
    assert chi_square_p_value(tokens, expected_distribution(LOGITS_8, 1.0, 0, 1.0)) < 1e-6


def test_a_seed_and_position_give_the_same_token_every_time() -> None:
    first = draw(LOGITS_8, 50, temperature=0.9, top_k=5, top_p=0.9, seed=3)
    assert draw(LOGITS_8, 50, temperature=0.9, top_k=5, top_p=0.9, seed=3) == first
    assert draw(LOGITS_8, 50, temperature=0.9, top_k=5, top_p=0.9, seed=4) != first


def test_top_k_keeps_the_k_largest_and_top_p_the_smallest_set_reaching_p() -> None:
    assert set(draw(QUARTER_LOGITS, 500, top_k=2)) == {2, 3}
    assert set(draw(QUARTER_LOGITS, 500, top_p=0.35)) == {3}  # 0.4 alone reaches 0.35
    assert set(draw(QUARTER_LOGITS, 500, top_p=0.5)) == {2, 3}  # 0.4 + 0.3 needed, as top-2


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
    for seed in (0, 5, 999):
        out = sample_rows(logits, settings_rows(temperature, top_k, top_p, [seed] * 4))
        assert out[0] == 1 and out[2] == 3


def test_greedy_row_is_argmax_even_when_the_top_two_nearly_tie() -> None:
    # A tiny temperature would still give the runner-up some mass here; greedy must not.
    logits = torch.tensor([[2.0, 2.00001, 0.0], [0.0, 1.0, 2.0]])
    temperature = torch.tensor([0.0, 1.0])
    for seed in (0, 3):
        out = sample_rows(logits, settings_rows(temperature, [0, 0], [1, 1], [seed, seed]))
        assert out[0] == 1


def test_all_greedy_batch_returns_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, -1.0], [7.0, 2.0, 6.5]])
    out = sample_rows(logits, settings_rows([0, 0], [0, 0], [1, 1], [9, 9]))
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize(("k", "temperature"), [(1, 1.0), (3, 1.0), (3, 0.5), (5, 2.0), (8, 1.0)])
def test_top_k_samples_only_the_k_largest(k: int, temperature: float) -> None:
    tokens = draw(LOGITS_8, 2000, temperature=temperature, top_k=k, seed=k)
    assert set(tokens) == k_largest(LOGITS_8, k)  # never outside; with 2000 draws every one shows up


@pytest.mark.parametrize(("p", "temperature"), [(0.3, 1.0), (0.6, 1.0), (0.8, 1.0), (0.6, 0.5), (0.9, 2.0)])
def test_top_p_samples_only_the_nucleus(p: float, temperature: float) -> None:
    allowed = nucleus(LOGITS_8, temperature, p)
    assert len(allowed) < len(LOGITS_8)  # the filter does something in every case
    tokens = draw(LOGITS_8, 2000, temperature=temperature, top_p=p, seed=int(p * 10))
    assert set(tokens) == allowed


def test_top_k_and_top_p_together() -> None:
    # top-4 by logit: 2.0, 1.8, 1.5, 1.0 -> nucleus of those renormalised probabilities
    top4 = sorted(k_largest(LOGITS_8, 4))
    sub = [LOGITS_8[i] for i in top4]
    allowed = {top4[i] for i in nucleus(sub, 1.0, 0.7)}
    assert allowed == k_largest(LOGITS_8, 3)  # by hand: 0.358, 0.293, 0.217, 0.132 -> 3 reach 0.7
    tokens = draw(LOGITS_8, 2000, top_k=4, top_p=0.7, seed=9)
    assert set(tokens) == allowed


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_argmax(temperature: float) -> None:
    tokens = draw(LOGITS_8, 2000, temperature=temperature, top_k=1, seed=1)
    assert set(tokens) == {1}  # 2.0 is the largest


def test_top_k_larger_than_the_vocabulary_keeps_everything() -> None:
    assert draw(LOGITS_8, 500, top_k=100, seed=4) == draw(LOGITS_8, 500, top_k=0, seed=4)


TARGETS = [  # (temperature, top_k, top_p) of the row under test
    (1.0, 0, 1.0),
    (0.8, 3, 1.0),
    (1.3, 0, 0.7),
    (0.6, 4, 0.8),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), TARGETS)
def test_a_row_is_sampled_the_same_alone_or_in_a_mixed_batch(temperature: float, top_k: int, top_p: float) -> None:
    n = 300
    alone = draw(LOGITS_8, n, temperature, top_k, top_p, seed=11)

    # The same rows at even positions; between them rows with other logits, seeds and every other kind of setting.
    others = [(0.0, 2, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.2), (0.5, 6, 0.95), (1.0, 100, 1.0)]
    other_logits = torch.randn(n, len(LOGITS_8), generator=torch.Generator().manual_seed(5)) * 3
    logits, rows = [], []
    for i in range(n):
        t, k, p = others[i % len(others)]
        logits += [LOGITS_8, other_logits[i].tolist()]
        rows += [SamplingRow(temperature, top_k, top_p, seed=11, position=i), SamplingRow(t, k, p, seed=i, position=7)]
    mixed = sample_rows(torch.tensor(logits), rows)
    assert mixed[0::2].tolist() == alone
    assert len(set(alone)) > 1  # the comparison is not between constants


SPREAD = torch.randn(200, 50257, generator=torch.Generator().manual_seed(21))  # [200, V]: no token above ~0.1 %


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.8, 0, 0.95), (1.5, 1000, 1.0)])
def test_a_small_change_of_the_logits_seldom_changes_a_token(temperature: float, top_k: int, top_p: float) -> None:
    # Another batch, chunk or cache path computes the logits with other roundings. Here every logit moves
    # by about 1e-3, far more than rounding does, over 50,257 tokens of which none is likely: the race
    # changes its choice only where its two best scores are within the change of each other (their gap
    # is distributed as Exp(1) in units of T), about 1 draw in 500. Inverse-CDF sampling, which the
    # server used before, changed 18 to 42 of these 200 draws: any change of the CDF moves it.
    rows = [SamplingRow(temperature, top_k, top_p, seed=5, position=i) for i in range(len(SPREAD))]
    nudged = SPREAD + 1e-3 * torch.randn(SPREAD.shape, generator=torch.Generator().manual_seed(22))
    tokens, nudged_tokens = sample_rows(SPREAD, rows), sample_rows(nudged, rows)
    assert (tokens != nudged_tokens).sum().item() <= 5
    assert len(set(tokens.tolist())) > 190  # the draws are spread over the vocabulary


def python_log_uniform(seed: int, position: int, token: int) -> float:
    """The noise's definition in plain Python integers (unsigned, masked): splitmix64 of (seed, position),
    lowbias32 of the token, lowbias32's last round and a half of both, the top 23 bits as a uniform."""
    mask64, mask32 = (1 << 64) - 1, (1 << 32) - 1

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask64
        return x ^ (x >> 31)

    def lowbias32(x: int) -> int:
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & mask32
        x = ((x ^ (x >> 15)) * 0x846CA68B) & mask32
        return x ^ (x >> 16)

    key = splitmix64((splitmix64(seed) + position) & mask64) & mask32
    bits = ((key ^ lowbias32((token * 0x9E3779B9) & mask32)) * 0x7FEB352D) & mask32
    bits = ((bits ^ (bits >> 15)) * 0x846CA68B) & mask32
    u = ((bits >> 9) + 0.5) / 2**23  # the top 23 bits
    return math.log(u)


def test_the_noise_is_the_hash_its_definition_gives_on_this_machine() -> None:
    # Torch's signed integers must wrap as unsigned ones do (multiplication) and the shifts be masked:
    # any machine where they do not gives other noise, and fails here.
    cases = [(0, 0), (1, 5), (2**63 - 1, 2**31 - 1), (12345678901234567, 100_000), (2**40 + 3, 7)]
    keys = torch.tensor([row_key(seed, position) for seed, position in cases], dtype=torch.int32)
    noise = log_uniforms(keys, id_hashes(50257, torch.device("cpu")))  # [5, V]
    for row, (seed, position) in enumerate(cases):
        for token in (0, 1, 2, 31337, 50256):
            assert noise[row, token].item() == pytest.approx(python_log_uniform(seed, position, token), rel=1e-6)


def test_the_noise_is_uniform_and_independent_of_its_neighbours() -> None:
    keys = torch.tensor([row_key(seed, position) for seed in range(4) for position in range(16)], dtype=torch.int32)
    log_u = log_uniforms(keys, id_hashes(50257, torch.device("cpu"))).double()  # [64, V]
    assert torch.isfinite(log_u).all() and (log_u < 0).all()  # E = -log u in (0, inf)
    u = log_u.exp().flatten()
    sorted_u = u.sort().values
    ks = (sorted_u - torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)).abs().max().item()
    assert ks < 1.95 / math.sqrt(len(u))  # Kolmogorov-Smirnov at 0.1 %
    # Neighbouring positions, neighbouring seeds, neighbouring tokens: no correlation beyond chance
    # (the standard error of a correlation over 50,257 pairs is 0.0045).
    rows = u.view(64, -1)
    pairs = [(rows[0], rows[1]), (rows[0], rows[16]), (rows[17], rows[32]), (rows[5, :-1], rows[5, 1:])]
    for a, b in pairs:
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.025


def test_a_sequence_keeps_its_seed_or_draws_one() -> None:
    assert Sequence([1, 2, 3], SamplingParams(seed=7)).seed == 7
    drawn = {Sequence([1, 2, 3], SamplingParams()).seed for _ in range(20)}
    assert len(drawn) == 20 and all(0 <= s < 2**63 for s in drawn)


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
        forced = [SamplingRow(temperature, seed=1, position=i, logit_bias=((7, 100.0),)) for i in range(200)]
        assert set(sample_rows(logits, forced).tolist()) == {7}
        best = logits.argmax(dim=1).tolist()
        banned = [SamplingRow(temperature, seed=2, position=i, logit_bias=((b, -100.0),)) for i, b in enumerate(best)]
        assert all(t != b for t, b in zip(sample_rows(logits, banned).tolist(), best))


def test_one_rows_penalties_and_bias_never_change_another_rows_token() -> None:
    n = 300
    logits = torch.randn(n, 8, generator=torch.Generator().manual_seed(8)) * 2
    plain = [SamplingRow(t, k, p, seed=4, position=i) for i, (t, k, p) in enumerate((TARGETS * n)[:n])]
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
        SamplingRow(0.8, top_k=3, seed=3),
        SamplingRow(1.2, top_p=0.7, seed=2**63 - 1, position=9, logit_bias=((1, 2.0),)),
        SamplingRow(1.0, seed=5, presence_penalty=0.5, repetition_penalty=1.3, output_ids=(1, 2), prompt_ids=(3,)),
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
