"""Tenants' load on the real engine and scheduler over a simulated runner, on the simulated clock: for the
fair-share tests and benchmarks/fairness.py. Nothing sleeps, so a long run takes seconds, and every
figure (tokens served, time to first token in simulated seconds) is the same on any machine.

A tenant's client either keeps `in_flight` requests in the server (closed loop: a backlogged tenant),
or sends one every `interval_s` simulated seconds (open loop: an interactive user).
"""

import random
from dataclasses import dataclass, field

from config import EngineSettings
from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence, Status
from sim.memory import sim_kv_blocks
from sim.runner import SimRunner


@dataclass(frozen=True, slots=True)
class Client:
    name: str  # the figures' key
    prompt_tokens: int
    max_tokens: int
    in_flight: int = 0  # closed loop: this many requests at all times
    interval_s: float = 0.0  # open loop: a request every interval_s simulated seconds
    vary: bool = False  # each request's prompt and max_tokens drawn from 1 to the sizes above
    tenant: str | None = None  # whose requests they are; None: the client's name

    @property
    def of(self) -> str:
        return self.name if self.tenant is None else self.tenant


@dataclass
class TenantFigures:
    generated_tokens: int = 0  # within the measured window
    prompt_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)  # of requests that arrived within the window
    requests: int = 0  # finished within the window


@dataclass
class LoadRun:
    figures: dict[str, TenantFigures]  # by client
    service: list[dict[str, float]]  # per step: each tenant's weighted service so far (over its weight)
    backlogged: list[bool]  # per step: whether every closed-loop tenant had a sequence waiting
    simulated_s: float
    window_s: float

    def share(self, client: str) -> float:
        total = sum(f.generated_tokens for f in self.figures.values())
        return self.figures[client].generated_tokens / total if total else 0.0

    def tokens_per_s(self, client: str) -> float:
        return self.figures[client].generated_tokens / self.window_s

    def drift(self, a: str, b: str) -> float:
        """The most tenant a's weighted service outgrew b's, or b's a's, over any stretch of steps where
        both were backlogged (docs/fairness.md's bound is on this)."""
        worst, low, high = 0.0, None, None
        for backlogged, service in zip(self.backlogged, self.service):
            if not backlogged:
                low = high = None
                continue
            diff = service[a] - service[b]
            low, high = min(diff, diff if low is None else low), max(diff, diff if high is None else high)
            worst = max(worst, high - low)
        return worst


def sim_engine(settings: EngineSettings) -> Engine:
    """The engine ENGINE=sim serves with, its runner's sleeps skipped (the clock is runner.simulated_s)."""
    runner = SimRunner.from_settings(settings, sleep=lambda _s: None)
    return Engine(runner, sim_kv_blocks(settings, runner.gpu, runner.model, runner.num_gpus), settings, runner.name)


def run_load(engine: Engine, clients: list[Client], duration_s: float, warmup_s: float = 0.0, seed: int = 0) -> LoadRun:
    """Run the clients for `duration_s` simulated seconds; figures over the time after `warmup_s`."""
    rng, clock = random.Random(seed), engine.runner
    figures = {c.name: TenantFigures() for c in clients}
    arrived: dict[int, tuple[Client, float]] = {}  # seq id -> its client and arrival time
    next_at = {c.name: 0.0 for c in clients if c.interval_s}
    fair, run = engine.scheduler.fair, LoadRun(figures, [], [], 0.0, duration_s - warmup_s)

    def send(client: Client) -> None:
        size, tokens = client.prompt_tokens, client.max_tokens
        if client.vary:
            size, tokens = rng.randint(1, size), rng.randint(1, tokens)
        prompt = [rng.randrange(50_000) for _ in range(size)]  # no prefix shared
        seq = Sequence(prompt, SamplingParams(max_tokens=tokens), tenant=client.of)
        arrived[seq.seq_id] = (client, clock.simulated_s)
        engine.add(seq)

    for client in clients:
        for _ in range(client.in_flight):
            send(client)
    while clock.simulated_s < duration_s:
        for client in clients:
            while client.interval_s and next_at[client.name] <= clock.simulated_s:
                send(client)
                next_at[client.name] += client.interval_s
        if not engine.has_work():  # idle until the next open-loop arrival
            clock.simulated_s = min(next_at.values())
            continue
        _record_backlog(engine, clients, run)
        results = engine.step()
        measuring = clock.simulated_s > warmup_s
        for seq, token in results:
            client, at = arrived[seq.seq_id]
            mine = figures[client.name]
            if token is not None and seq.num_generated == 1 and at >= warmup_s:
                mine.ttfts_s.append(clock.simulated_s - at)
            if measuring:
                mine.generated_tokens += token is not None
            if seq.status is Status.FINISHED:
                mine.requests += measuring
                del arrived[seq.seq_id]
                if client.in_flight:
                    send(client)
        weighted = fair.input_weight, fair.output_weight
        run.service.append({c.of: _service(fair, c.of, weighted) for c in clients})
    run.simulated_s = clock.simulated_s
    return run


def _record_backlog(engine: Engine, clients: list[Client], run: LoadRun) -> None:
    waiting = {s.tenant for s in engine.scheduler.waiting}
    run.backlogged.append(all(c.of in waiting for c in clients if c.in_flight))


def _service(fair, tenant: str, weights: tuple[float, float]) -> float:
    """The tenant's weighted service so far, over its weight (the ledger's tokens: no lifts in it)."""
    label = fair.ledger.label(tenant)
    tokens = weights[0] * fair.ledger.prompt_tokens[label] + weights[1] * fair.ledger.generated_tokens[label]
    return tokens / fair.weight(tenant)
