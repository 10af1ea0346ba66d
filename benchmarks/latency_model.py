"""The latency model against the real engine: profile this device, predict, measure.

    python -m benchmarks.latency_model --profile profiles/cpu.toml   # a profile from sim.profiler
    python -m benchmarks.latency_model --save profiles/cpu.toml      # profile now, keep the file

For every prompt length x response length x batch size, `batch` requests of random
prompts of that length are generated together by Engine.generate (greedy, exactly
`response` tokens each, the prefix cache off); the wall time is the measured end-to-end
latency, sim.simulate's total with the profile the predicted one. DEVICE and DTYPE apply.
"""

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from config import EngineSettings
from generate.engine import Engine, device_and_dtype
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams
from model.loader import LoadedModel, load_model
from sim.profiler import BATCH_SIZES, CONTEXTS, PREFILL_LENGTHS, REPEATS, gpt2_profile, profile
from sim.profiles import GpuProfile, load_gpu, write_gpu_profile
from sim.simulate import simulate

BLOCK_SIZE = 16


class Row(NamedTuple):
    prompt: int
    response: int
    batch: int
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def grid_engine(loaded: LoadedModel, max_prompt: int, max_response: int, max_batch: int) -> Engine:
    """One engine for the whole grid: the largest batch prefills in one step and never runs short of blocks."""
    needed = max_batch * -(-(max_prompt + max_response) // BLOCK_SIZE)
    blocks = needed + needed // 50 + 2  # room for the scheduler's admission watermark
    settings = EngineSettings(
        block_size=BLOCK_SIZE,
        kv_cache_blocks=blocks,
        max_batch_size=max_batch,
        max_batch_tokens=max(loaded.model.config.n_positions, max_batch * max_prompt),
        prefix_cache=False,  # repeated runs must not skip their prefill
    )
    return Engine(ModelRunner.from_settings(loaded.model, blocks, settings), blocks, settings, loaded.name)


def measure_latency(engine: Engine, prompt: int, response: int, batch: int, repeats: int, seed: int) -> float:
    """Median wall time of generating `response` tokens for `batch` random `prompt`-token prompts at once."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.runner.model.config.vocab_size
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None
    params = SamplingParams(max_tokens=response, temperature=0)  # stop_at_eos is off: exactly `response` tokens
    times = []
    for _ in range(repeats):
        prompts = torch.randint(0, vocab, (batch, prompt), generator=gen).tolist()
        sync()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - start)
        assert all(len(o) == response for o in outputs)
    return statistics.median(times)


def validate(
    gpu: GpuProfile, loaded: LoadedModel, prompts: list[int], responses: list[int], batches: list[int], repeats: int
) -> list[Row]:
    engine = grid_engine(loaded, max(prompts), max(responses), max(batches))
    model = gpt2_profile(loaded.name, loaded.model.config, loaded.model.wte.weight.dtype)
    measure_latency(engine, min(prompts), 2, max(batches), 1, seed=-1)  # warm-up: every code path once
    rows = []
    for prompt in prompts:
        for response in responses:
            for batch in batches:
                predicted = simulate(gpu, model, prompt, response, batch).total_s
                measured = measure_latency(engine, prompt, response, batch, repeats, seed=len(rows))
                rows.append(Row(prompt, response, batch, predicted, measured))
    return rows


def summary(rows: list[Row]) -> tuple[float, float]:
    """Median and worst absolute relative error."""
    errors = [abs(r.error) for r in rows]
    return statistics.median(errors), max(errors)


def print_table(rows: list[Row]) -> None:
    print(f"{'prompt':>6} {'response':>8} {'batch':>5} {'predicted s':>12} {'measured s':>11} {'error':>8}")
    for r in rows:
        cells = f"{r.prompt:>6} {r.response:>8} {r.batch:>5} {r.predicted_s:>12.3f} {r.measured_s:>11.3f}"
        print(f"{cells} {r.error:>+8.1%}")
    median, worst = summary(rows)
    print(f"median |error| {median:.1%}, worst |error| {worst:.1%} over {len(rows)} points")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2", help="a MODEL setting; random weights time the same")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, help="a profile file written by sim.profiler")
    source.add_argument("--save", type=Path, help="profile now and write the profile here")
    parser.add_argument("--prompts", type=_ints, default=[32, 128, 512])
    parser.add_argument("--responses", type=_ints, default=[16, 64])
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per point; the median counts")
    args = parser.parse_args()
    settings = EngineSettings.from_env()  # DEVICE, DTYPE, SEED
    if args.profile:
        gpu = load_gpu(str(args.profile))
    else:
        name = args.save.stem if args.save else "profiled"
        gpu, measured = profile(args.model, name, settings, PREFILL_LENGTHS, BATCH_SIZES, CONTEXTS, REPEATS)
        if args.save:
            write_gpu_profile(args.save, gpu, measured)
    device, dtype = device_and_dtype(settings)
    loaded = load_model(args.model, device, dtype, settings.seed)
    print(f"{loaded.name} on {device} ({torch.get_num_threads()} threads), {dtype}, torch {torch.__version__}")
    print(
        f"profile {gpu.name}: {gpu.flops / 1e9:,.1f} GFLOP/s, {gpu.bandwidth / 1e9:,.1f} GB/s, "
        f"{gpu.step_overhead_s * 1e3:.2f} ms per step"
    )
    print_table(validate(gpu, loaded, args.prompts, args.responses, args.batches, args.repeats))


if __name__ == "__main__":
    main()
