"""Prefix cache on vs off, in one run, on the engine itself.

Workloads, all requests arriving at once, greedy, the same prompts for both settings:
  shared   one ~500-token system prompt in front of every short question;
  unshared every prompt has its own ~500-token text (the cache can only cost here).

python -m benchmarks.prefix_cache --model gpt2 --requests 200
"""

import argparse
import random
import time
from typing import NamedTuple

import torch

from config import EngineSettings
from generate.engine import Engine
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams, Sequence
from kvcache.pool_size import pool_blocks
from model.loader import load_model
from model.tokenizer import load_tokenizer

WORDS = (
    "you are a helpful assistant answer briefly and politely the user asks about ships storms weather maps "
    "harbours lighthouses tides rivers bridges trains music history science cooking gardens mountains"
).split()


class Result(NamedTuple):
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    hit_rate: float
    outputs: list[list[int]]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(kind: str, requests: int, seed: int) -> list[list[int]]:
    tok, rng = load_tokenizer(), random.Random(seed)
    system = tok.encode(text(rng, 450))[:500]
    questions = [tok.encode(f"\nQuestion {i}: {text(rng, rng.randint(5, 20))}?\nAnswer:") for i in range(requests)]
    if kind == "shared":
        return [system + q for q in questions]
    return [tok.encode(text(rng, 450))[:500] + q for q in questions]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Result:
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    seqs = [Sequence(list(p), params) for p in prompts]
    first_token: dict[int, float] = {}
    start = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        for seq, token in engine.step():
            if token is not None:
                first_token.setdefault(seq.seq_id, time.perf_counter() - start)
    duration = time.perf_counter() - start
    ttft = [first_token[s.seq_id] for s in seqs]
    scheduler = engine.scheduler
    return Result(
        tokens_per_s=len(seqs) * new_tokens / duration,
        ttft_p50_s=percentile(ttft, 0.5),
        ttft_p99_s=percentile(ttft, 0.99),
        hit_rate=scheduler.prompt_tokens_cached / scheduler.prompt_tokens_admitted,
        outputs=[s.completion_ids for s in seqs],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="a preset name; random weights")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loaded = load_model(f"random:{args.model}", torch.device("cpu"), torch.float32)
    print(
        f"random:{args.model} on CPU ({torch.get_num_threads()} threads), {args.requests} requests at once, "
        f"{args.new_tokens} new tokens each, greedy"
    )
    print(f"{'workload':<10}{'cache':>6}{'tok/s':>9}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'hit rate':>10}")
    for kind in ("shared", "unshared"):
        prompts = workload(kind, args.requests, args.seed)
        results = {}
        for cache in (False, True):
            settings = EngineSettings(kv_cache_gb=args.kv_cache_gb, prefix_cache=cache)
            num_blocks = pool_blocks(settings, loaded.model.config.kv_bytes_per_token(torch.float32), 4 * 2**30)
            runner = ModelRunner.from_settings(loaded.model, num_blocks, settings)
            engine = Engine(runner, num_blocks, settings, loaded.name)
            results[cache] = r = run(engine, prompts, args.new_tokens)
            print(
                f"{kind:<10}{'on' if cache else 'off':>6}{r.tokens_per_s:>9.1f}{r.ttft_p50_s:>12.2f}"
                f"{r.ttft_p99_s:>12.2f}{r.hit_rate:>10.1%}"
            )
        off, on = results[False], results[True]
        same = "identical" if off.outputs == on.outputs else "DIFFERENT"
        print(
            f"{'':<10}{'on/off':>6}{on.tokens_per_s / off.tokens_per_s:>8.2f}x"
            f"{off.ttft_p50_s / on.ttft_p50_s:>11.2f}x lower{'':>5}greedy outputs {same}"
        )


if __name__ == "__main__":
    main()
