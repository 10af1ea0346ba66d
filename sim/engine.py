"""ENGINE=sim: the real engine (scheduler, KV bookkeeping) over a runner that sleeps a cost model's step time."""

import logging

from config import EngineSettings
from generate.engine import Engine
from sim.memory import sim_kv_blocks
from sim.runner import SimRunner

log = logging.getLogger(__name__)


def simulated_engine(settings: EngineSettings, announce: bool = True) -> Engine:
    runner = SimRunner.from_settings(settings)
    num_blocks = sim_kv_blocks(settings, runner.gpu, runner.model, runner.num_gpus)
    if announce:
        for line in (
            "=" * 72,
            f"SIMULATED ENGINE {runner.name}: no model runs, the tokens are deterministic filler.",
            "Each step sleeps for the time a cost model predicts: timings are a model, not a measurement.",
            f"KV cache: {num_blocks} blocks of {settings.block_size} tokens (GPU memory minus weights)",
            "=" * 72,
        ):
            log.warning(line)
    return Engine(runner, num_blocks, settings, runner.name)
