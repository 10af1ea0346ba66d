"""The engine's `sample` stage alone: the Sampler over one step's logits, as a decode step calls it.

Each of `batch` sequences samples its next token (temperature 1, or --temperature, and a seed, as a
seeded chat request; optionally top-k/top-p) from [batch, 50257] float32 logits spread as GPT-2's are (the
cost does not depend on the weights, only on the shape and the stages the settings turn on).
Prints the median and quartiles of the stage's time per step, in milliseconds:

    python -m benchmarks.sampling --batch-sizes 1,64 --steps 50
    DEVICE=cuda python -m benchmarks.sampling --batch-sizes 1,64,256
"""

import argparse
import statistics
import time

import torch

from generate.sampler import Sampler
from generate.sequence import SamplingParams, Sequence

VOCAB = 50257


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=50, help="timed calls per batch size")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    return parser.parse_args()


def sampling_step(batch: int, params: SamplingParams, device: torch.device) -> tuple[Sampler, list[Sequence]]:
    seqs = [Sequence(list(range(1, 20)), params) for _ in range(batch)]
    for seq in seqs:
        seq.num_scheduled_tokens = 1
        seq.num_computed_tokens = len(seq.token_ids) - 1  # a decode step: the last token, then sampling
    return Sampler(device), seqs


def time_stage(batch: int, steps: int, params: SamplingParams, device: torch.device) -> list[float]:
    """Seconds per call, `steps` calls after two untimed ones."""
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 3).to(device)  # [batch, V]
    sampler, seqs = sampling_step(batch, params, device)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        sampler(seqs, logits)  # returns host ints: the device has finished
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=1, max_tokens=1000)
    print(f"sample stage, {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("batch  median_ms  q1_ms  q3_ms")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        times = [t * 1e3 for t in time_stage(batch, args.steps, params, torch.device(args.device))]
        q1, median, q3 = statistics.quantiles(times, n=4)
        print(f"{batch:5d}  {median:9.2f}  {q1:5.2f}  {q3:5.2f}")


if __name__ == "__main__":
    main()
