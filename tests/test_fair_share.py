"""Fair share between tenants on the real scheduler over the simulated runner, on its clock (sim/tenant_load.py):
shares of generated tokens, an interactive user beside a flood, the counter bound over a long run, and
FAIR_SHARE=false scheduling exactly as first come, first served."""

import pytest
from conftest import random_prompts
from test_model import make_engine, run_checked
from test_priority import greedy

from config import EngineSettings
from generate.fair_share import FairShare
from generate.sequence import SamplingParams, Sequence
from sim.tenant_load import Client, run_load, sim_engine

SEATS = 8


def engine(fair: bool = True, weights: dict[str, float] | None = None, **settings):
    base = dict(engine="sim", sim_model="gpt2", sim_gpu="profiles/cpu.toml", dtype="float32", max_batch_size=SEATS)
    eng = sim_engine(EngineSettings(fair_share=fair, **base, **settings))
    eng.scheduler.fair.weights.update(weights or {})
    return eng


@pytest.mark.parametrize("fair", [True, False])
def test_two_backlogged_tenants_share_generated_tokens_equally_whatever_their_requests_in_flight(fair):
    flood, small = Client("flood", 16, 64, in_flight=3 * SEATS), Client("small", 16, 64, in_flight=SEATS)
    run = run_load(engine(fair), [flood, small], duration_s=120, warmup_s=20)
    if fair:
        assert all(run.backlogged)  # each has seats' worth waiting: both always compete
        assert run.share("small") == pytest.approx(0.5, abs=0.1)
    else:  # first come, first served: seats in proportion to requests in flight
        assert run.share("small") == pytest.approx(0.25, abs=0.05)


def test_a_tenant_of_weight_2_gets_two_thirds():
    heavy, light = Client("heavy", 16, 64, in_flight=2 * SEATS), Client("light", 16, 64, in_flight=2 * SEATS)
    run = run_load(engine(weights={"heavy": 2.0}), [heavy, light], duration_s=120, warmup_s=20)
    assert run.share("heavy") == pytest.approx(2 / 3, abs=0.1)


def ttft_p90(run, tenant: str) -> float:
    ttfts = sorted(run.figures[tenant].ttfts_s)
    assert len(ttfts) >= 50
    return ttfts[int(0.9 * len(ttfts))]


def test_an_interactive_user_beside_a_flood_gets_its_first_token_fast_and_the_flood_keeps_its_throughput():
    def with_user_as(tenant: str):
        flood, user = Client("flood", 16, 64, in_flight=3 * SEATS), Client("user", 8, 16, interval_s=1.0, tenant=tenant)
        return run_load(engine(), [flood, user], duration_s=150, warmup_s=20)

    apart, shared = with_user_as("user"), with_user_as("flood")
    assert ttft_p90(apart, "user") <= 0.5 * ttft_p90(shared, "user")
    assert apart.tokens_per_s("flood") >= 0.6 * shared.tokens_per_s("flood")


@pytest.mark.parametrize("fair", [True, False])
def test_the_service_of_two_backlogged_tenants_never_drifts_past_the_bound(fair):
    # mixed sizes; the bound (docs/fairness.md): 2 (w_in L + S w_out M) / min weight
    longest_prompt, most_tokens, weights = 48, 40, {"a": 2.0, "b": 1.0}
    clients = [Client("a", longest_prompt, most_tokens, 3 * SEATS, vary=True), Client("b", 24, most_tokens, SEATS)]
    eng = engine(fair, weights)
    run = run_load(eng, clients, duration_s=400, seed=3)
    fs = eng.scheduler.fair
    bound = 2 * (fs.input_weight * longest_prompt + SEATS * fs.output_weight * most_tokens) / 1.0
    assert sum(run.backlogged) > 0.9 * len(run.backlogged) and len(run.service) > 3000
    if fair:
        assert run.drift("a", "b") <= bound
    else:  # first come, first served drifts without limit: the check can fail
        assert run.drift("a", "b") > bound


def schedule_trace(fair: bool, tenants: list[str], priorities: list[int]) -> list[list[tuple[int, int]]]:
    """Each step's scheduled (request number, tokens) for a fixed mix of requests, some added mid-run."""
    eng = engine(fair, max_batch_tokens=64, priority_aging_s=0.5)
    seqs = []
    for i, (tenant, priority) in enumerate(zip(tenants, priorities)):
        prompt = [(i * 7919 + j) % 50_000 for j in range(5 + (i * 13) % 40)]
        seqs.append(Sequence(prompt, SamplingParams(max_tokens=3 + (i * 5) % 20), priority=priority, tenant=tenant))
    number = {s.seq_id: i for i, s in enumerate(seqs)}
    trace, pending = [], list(seqs)
    while pending or eng.has_work():
        for _ in range(3):
            if pending:
                eng.add(pending.pop(0))
        trace.append([(number[s.seq_id], t) for s, t in ((r.seq, r.seq.num_computed_tokens) for r in eng.step())])
    assert [len(s.completion_ids) for s in seqs] == [s.params.max_tokens for s in seqs]
    return trace


def test_fair_share_off_schedules_exactly_as_without_tenants():
    n = 40
    tenants, priorities = [["a", "b", "b", "c"][i % 4] for i in range(n)], [i % 3 for i in range(n)]
    reference = schedule_trace(False, [""] * n, priorities)
    assert schedule_trace(False, tenants, priorities) == reference
    # and with one tenant, fair share schedules exactly as without it
    assert schedule_trace(True, [""] * n, priorities) == reference
    assert schedule_trace(True, tenants, [0] * n) != schedule_trace(False, tenants, [0] * n)


def test_a_tenant_coming_back_is_lifted_to_the_smallest_active_counter_and_idle_ones_are_forgotten():
    fair = FairShare(1.0, 2.0)
    fair.arrive("a")
    fair.charge("a", prompt_tokens=100, generated_tokens=50)  # 200
    fair.arrive("b")
    assert fair.service("b") == 200  # no head start from having been away
    fair.charge("b", generated_tokens=10)  # 220
    fair.leave("a")  # a is idle at 200, below the floor (b, 220): forgotten
    assert "a" not in fair.counters
    fair.arrive("a")
    assert fair.service("a") == 220
    fair.charge("a", generated_tokens=100)  # 420
    fair.leave("a")  # idle above the floor: kept, so coming back does not forgive its lead
    fair.arrive("a")
    assert fair.service("a") == 420
    fair.leave("a")
    fair.leave("b")  # nobody active: a newcomer starts at the last one's counter
    fair.arrive("c")
    assert fair.service("c") == 220


def test_tenant_labels_are_capped_and_the_rest_count_as_other():
    fair = FairShare()
    fair.ledger.max_labels = 3
    for t in ["", "a", "b", "c", "d"]:
        fair.arrive(t)
        fair.charge(t, generated_tokens=1)
    assert fair.ledger.read(fair.ledger.generated_tokens) == {"shared": 1, "a": 1, "b": 1, "other": 2}


def test_outputs_stay_transformers_greedy_ones_when_fair_share_reorders_tenants(tiny_checkpoint, hf_greedy):
    eng = make_engine(tiny_checkpoint, max_batch_size=2, max_batch_tokens=32)
    prompts = random_prompts([9, 14, 6, 11, 20, 7], seed=60)
    seqs = [greedy(6 + i, 0, p) for i, p in enumerate(prompts)]
    for i, seq in enumerate(seqs):
        seq.tenant = "flood" if i < 4 else f"user{i}"
    run_checked(eng, seqs)
    assert [s.completion_ids for s in seqs] == [hf_greedy(p, s.params.max_tokens) for p, s in zip(prompts, seqs)]
