"""Measure the real engine on this device and fit the cost model's constants to it.

    python -m sim.profiler --model random:gpt2 --out profiles/cpu.toml
    DEVICE=cuda python -m sim.profiler --model random:gpt2 --out profiles/h100.toml

Whole engine steps are timed (scheduling, the forward pass, sampling, bookkeeping), after
warm-up, with time.perf_counter (and torch.cuda.synchronize on CUDA):
  prefill  one prompt at a time over prompt lengths; a linear fit gives prompt tokens/s;
  decode   steps over batch sizes x context lengths. Their caches are laid out without
           running the prefills: a step's time does not depend on the values it reads.
Then the cost model's own constants (effective FLOP/s, effective bandwidth, per-step
overhead) are fitted to every measured step by non-negative least squares on relative
error, and written as a GPU profile (efficiencies 1: the constants are already effective)
that SIM_GPU and sim.simulate accept, with the raw measurements kept beside it.
"""

import argparse
import os
import statistics
import time
from itertools import combinations
from pathlib import Path
from typing import NamedTuple

import torch

from config import EngineSettings
from generate.engine import Engine, device_and_dtype
from generate.grammar_mask import StepMasks
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams, Sequence
from generate.step_log import StageClock
from model.gpt2 import GPTConfig
from model.loader import load_model
from sim.cost import step_bytes, step_cost, step_flops
from sim.profiles import GpuProfile, ModelProfile, write_gpu_profile

BLOCK_SIZE = 16
# What is measured by default: prompt lengths at batch 1; batch sizes x context lengths of decode steps.
PREFILL_LENGTHS = [16, 32, 64, 128, 256, 512, 1024]
BATCH_SIZES = [1, 2, 4, 8, 16, 32]
CONTEXTS = [64, 256, 768]
REPEATS = 3


class Step(NamedTuple):
    seqs: tuple[tuple[int, int], ...]  # (new tokens, context length) of each sequence
    seconds: float  # median of the repeats


class Measurements(NamedTuple):
    prefill: list[Step]
    decode: list[Step]


def gpt2_profile(name: str, config: GPTConfig, dtype: torch.dtype) -> ModelProfile:
    """The cost model's view of this project's GPT-2 (the architecture of the gpt2 entries in models.toml)."""
    return ModelProfile(
        name=name,
        n_layer=config.n_layer,
        n_head=config.n_head,
        d_model=config.n_embd,
        d_ff=4 * config.n_embd,
        vocab_size=config.vocab_size,
        context_len=config.n_positions,
        learned_positions=config.n_positions,
        gated_mlp=False,
        bias=True,
        norm="layernorm",
        tied_embeddings=True,
        bytes_per_param=torch.tensor([], dtype=dtype).element_size(),
    )


class _Runner:
    """The model runner, able to skip a step's compute when only the cache's layout matters."""

    def __init__(self, inner: ModelRunner):
        self.inner, self.max_context, self.on_gpu, self.skip = inner, inner.max_context, inner.on_gpu, False

    def run(self, seqs: list[Sequence], clock: StageClock, masks: StepMasks | None = None) -> list[int | None]:
        if self.skip:
            return [0 if s.samples_this_step else None for s in seqs]
        return self.inner.run(seqs, clock, masks)


def measure(
    engine: Engine, lengths: list[int], batches: list[int], contexts: list[int], repeats: int, seed: int = 0
) -> Measurements:
    runner = engine.runner
    assert isinstance(runner, _Runner)
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.inner.model.config.vocab_size
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()
    sync = torch.cuda.synchronize if runner.inner.device.type == "cuda" else lambda: None

    def timed_step() -> float:
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - start

    prefill = []
    for n in lengths:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            engine.add(Sequence(prompt(n), SamplingParams(max_tokens=1, temperature=0)))
            times.append(timed_step())
        prefill.append(Step(((n, n),), statistics.median(times[1:])))
    decode = []
    for batch in batches:
        for context in contexts:
            params = SamplingParams(max_tokens=repeats + 3, temperature=0)
            seqs = [Sequence(prompt(context - 1), params) for _ in range(batch)]
            for seq in seqs:
                engine.add(seq)
            runner.skip = True
            engine.step()  # admits them all, lays out their caches; each now holds `context` tokens
            runner.skip = False
            assert len(engine.scheduler.running) == batch, "the whole batch must decode together"
            timed_step()  # warm-up
            times = [timed_step() for _ in range(repeats)]
            middle = context + 1 + repeats // 2  # context of the median-ish step
            decode.append(Step(((1, middle),) * batch, statistics.median(times)))
            for seq in seqs:
                engine.abort(seq)
    return Measurements(prefill, decode)


def fit_constants(model: ModelProfile, steps: list[Step]) -> tuple[float, float, float]:
    """(overhead s, FLOP/s, bytes/s) minimising the steps' relative errors, none negative."""
    t = torch.tensor([s.seconds for s in steps], dtype=torch.float64)  # [S]
    features = torch.tensor(
        [[1.0, step_flops(model, s.seqs), step_bytes(model, s.seqs)] for s in steps], dtype=torch.float64
    )  # [S, 3]
    a = features / t.unsqueeze(1)  # relative: each row predicts 1
    scale = a.norm(dim=0)  # [3] columns differ by ~1e12; scaling keeps lstsq well conditioned
    a = a / scale
    best, best_residual = None, float("inf")
    # Exact non-negative least squares for three unknowns: the best unconstrained fit over
    # each subset of them, keeping the subsets whose solution is non-negative.
    for k in (1, 2, 3):
        for cols in combinations(range(3), k):
            x = torch.linalg.lstsq(a[:, cols], torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
            residual = float((a[:, cols] @ x - 1).norm())
            if bool((x >= 0).all()) and residual < best_residual:
                best, best_residual = torch.zeros(3, dtype=torch.float64), residual
                best[list(cols)] = x
    assert best is not None
    overhead, per_flop, per_byte = (best / scale).tolist()
    return overhead, 1 / per_flop if per_flop else float("inf"), 1 / per_byte if per_byte else float("inf")


def prompt_tokens_per_s(prefill: list[Step]) -> float:
    """1 / slope of a linear fit of prefill time over prompt length."""
    n = torch.tensor([float(s.seqs[0][0]) for s in prefill], dtype=torch.float64)
    t = torch.tensor([s.seconds for s in prefill], dtype=torch.float64)
    slope = float(((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum())
    return 1 / slope


def profile(
    spec: str,
    name: str,
    settings: EngineSettings,
    lengths: list[int],
    batches: list[int],
    contexts: list[int],
    repeats: int,
) -> tuple[GpuProfile, dict]:
    """Measure the engine serving `spec` (DEVICE, DTYPE from `settings`); the fitted profile and the measurements."""
    device, dtype = device_and_dtype(settings)
    loaded = load_model(spec, device, dtype, settings.seed)
    limit = loaded.model.config.n_positions
    lengths = sorted({min(n, limit - 1) for n in lengths})  # each prompt gets one token
    contexts = sorted({min(c, limit - repeats - 3) for c in contexts})  # and each decode batch repeats + 3
    longest = max(contexts) + repeats + 3
    needed = max(batches) * -(-longest // BLOCK_SIZE)
    blocks = needed + needed // 50 + 2  # room for the scheduler's admission watermark
    engine_settings = EngineSettings(
        block_size=BLOCK_SIZE,
        kv_cache_blocks=blocks,
        max_batch_size=max(batches),
        max_batch_tokens=max(limit, max(batches) * longest),
        prefix_cache=False,  # repeated prompts must not skip their prefill
    )
    runner = _Runner(ModelRunner.from_settings(loaded.model, blocks, engine_settings))
    found = measure(Engine(runner, blocks, engine_settings, loaded.name), lengths, batches, contexts, repeats)
    model = gpt2_profile(loaded.name, loaded.model.config, dtype)
    steps = found.prefill + found.decode
    overhead, flops, bandwidth = fit_constants(model, steps)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else _ram_bytes()
    gpu = GpuProfile(name, flops, bandwidth, memory / 2**30, 1.0, 1.0, overhead)
    errors = [abs(step_cost(gpu, model, s.seqs).total_s / s.seconds - 1) for s in steps]
    measured = {
        "device": _device_name(device),
        "model": loaded.name,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes_per_param": model.bytes_per_param,
        "torch": torch.__version__,
        "prompt_tokens_per_s": prompt_tokens_per_s(found.prefill),
        "fit_median_error": statistics.median(errors),  # |fitted - measured| / measured over these steps
        "fit_worst_error": max(errors),
        "prefill": [[s.seqs[0][0], s.seconds] for s in found.prefill],  # [prompt tokens, s] at batch 1
        "decode": [[len(s.seqs), s.seqs[0][1], s.seconds] for s in found.decode],  # [batch, context, s]
    }
    return gpu, measured


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2", help="a MODEL setting; random weights time the same")
    parser.add_argument("--out", type=Path, required=True, help="the profile file to write")
    parser.add_argument("--name", help="the profile's name (default: the file's stem)")
    parser.add_argument("--prefill-lengths", type=_ints, default=PREFILL_LENGTHS)
    parser.add_argument("--batch-sizes", type=_ints, default=BATCH_SIZES)
    parser.add_argument("--contexts", type=_ints, default=CONTEXTS)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs of each point; the median counts")
    args = parser.parse_args()
    settings = EngineSettings.from_env()  # DEVICE, DTYPE, SEED
    grid = (args.prefill_lengths, args.batch_sizes, args.contexts, args.repeats)
    gpu, measured = profile(args.model, args.name or args.out.stem, settings, *grid)
    write_gpu_profile(args.out, gpu, measured)
    print(
        f"{measured['device']}, {measured['model']} {measured['dtype']}: {measured['prompt_tokens_per_s']:,.0f} prompt "
        f"tok/s; fitted {gpu.flops / 1e9:,.1f} GFLOP/s, {gpu.bandwidth / 1e9:,.1f} GB/s, "
        f"{gpu.step_overhead_s * 1e3:.2f} ms per step -> {args.out}"
    )


if __name__ == "__main__":
    main()
