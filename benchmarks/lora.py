"""What serving LoRA adapters costs: a decode step whose rows are spread over several adapters against
a step of the base model alone, and the throughput of requests spread over the adapters against the
same requests all on the base model. The engine in process, through its scheduler (no HTTP).

Adapters are written as peft saves them (random weights, every target of every layer: the most an
adapter can cost) and loaded through the server's own loader. Base and adapter runs alternate,
`--repeats` times each, so a machine that gets busier mid-run biases neither; medians are reported.

    python -m benchmarks.lora                            # random:gpt2, batch 64, 4 adapters of rank 16
    python -m benchmarks.lora --batch 64 --steps 20 --requests 64 --max-tokens 32 --repeats 3
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from config import EngineSettings
from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence
from model.gpt2 import GPTConfig
from model.lora import TARGETS, target_shapes

STEP_TARGET, THROUGHPUT_TARGET = 1.3, 0.75  # the goals: step time at most 1.3x, throughput at least 0.75x


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="sequences in the timed decode steps")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per run")
    parser.add_argument("--requests", type=int, default=64, help="requests of the throughput runs, all at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each of them generates")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating")
    return parser.parse_args()


def write_adapter(directory: Path, config: GPTConfig, rank: int, seed: int) -> Path:
    """A peft-format adapter of random weights on every target of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.n_layer):
        for target, (n_in, n_out) in target_shapes(config).items():
            name = f"base_model.model.transformer.h.{layer}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    targets = sorted({t.split(".")[1] for t in TARGETS})
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (directory / "adapter_config.json").write_text(json.dumps({**config_json, "fan_in_fan_out": True}))
    return directory


def random_prompt(gen: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=gen).tolist()


def decode_step_s(engine: Engine, names: list[str | None], context: int, steps: int) -> float:
    """Median time of a decode step of len(names) sequences, sequence i through adapter names[i]."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=steps + len(names) + 4, temperature=0)  # none ends while timed
    seqs = [Sequence(random_prompt(gen, context), params, lora=engine.loras.get(n) if n else None) for n in names]
    for seq in seqs:
        engine.add(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()  # the prompts, and a first decode step of every sequence
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        results = engine.step()
        times.append(time.perf_counter() - start)
        assert len(results) == len(seqs), "every sequence decodes in every timed step"
    for seq in seqs:
        engine.abort(seq)
    return statistics.median(times)


def throughput(engine: Engine, names: list[str | None], max_tokens: int) -> float:
    """Output tokens per second of len(names) requests (prompts of 16-128 tokens) sent at once."""
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    lengths = torch.randint(16, 129, (len(names),), generator=gen).tolist()
    seqs = [
        Sequence(random_prompt(gen, n), params, lora=engine.loras.get(a) if a else None) for a, n in zip(names, lengths)
    ]
    start = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return sum(s.num_generated for s in seqs) / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    blocks = 4 * args.batch * -(-(args.context + args.steps + 8) // 16) + 4 * args.requests * 12
    settings = EngineSettings(
        model=args.model, max_loras=args.adapters, max_lora_rank=args.rank, kv_cache_blocks=blocks,
        max_batch_size=max(args.batch, args.requests), prefix_cache=False,
    )  # fmt: skip
    engine = Engine.from_settings(settings)
    with tempfile.TemporaryDirectory() as tmp:  # read into memory by the loader: the files can go
        for i in range(args.adapters):
            engine.loras.load(
                f"lora{i}", str(write_adapter(Path(tmp) / f"lora{i}", engine.runner.model.config, args.rank, i))
            )
    spread = lambda n: [f"lora{i % args.adapters}" for i in range(n)]  # noqa: E731
    steps = {"base": [], "lora": []}
    rates = {"base": [], "lora": []}
    for i in range(args.repeats):
        steps["base"].append(decode_step_s(engine, [None] * args.batch, args.context, args.steps))
        steps["lora"].append(decode_step_s(engine, spread(args.batch), args.context, args.steps))
        print(
            f"run {i + 1}: decode step base {steps['base'][-1]:.3f} s, adapters {steps['lora'][-1]:.3f} s", flush=True
        )
        rates["base"].append(throughput(engine, [None] * args.requests, args.max_tokens))
        rates["lora"].append(throughput(engine, spread(args.requests), args.max_tokens))
        print(
            f"run {i + 1}: throughput base {rates['base'][-1]:.1f}, adapters {rates['lora'][-1]:.1f} tok/s", flush=True
        )
    step = {k: statistics.median(v) for k, v in steps.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    device = engine.runner.device
    print(f"{args.model} on {device}, {args.adapters} adapters of rank {args.rank} (every target, every layer)")
    print(f"decode step, batch {args.batch}, context ~{args.context}: base {step['base'] * 1e3:.1f} ms, "
          f"spread over the adapters {step['lora'] * 1e3:.1f} ms: {step['lora'] / step['base']:.2f}x "
          f"(target <= {STEP_TARGET}x)")  # fmt: skip
    print(f"throughput, {args.requests} requests x {args.max_tokens} tokens: base {rate['base']:.1f} tok/s, "
          f"spread over the adapters {rate['lora']:.1f} tok/s: {rate['lora'] / rate['base']:.2f}x "
          f"(target >= {THROUGHPUT_TARGET}x)")  # fmt: skip
    print(f"runs (s / tok/s): steps {steps}, throughput {rates}")


if __name__ == "__main__":
    main()
