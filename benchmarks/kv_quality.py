"""What a lossy mode does to a model that has learned something: an int8 or fp8 KV cache, int8 weights, both.

Teacher-forced over held-out text (the standard library's files that benchmarks/train_instrument.py held out),
each mode's engine reads every window through its own paged cache exactly as it serves: a first chunk of
--prefill tokens (a prompt's prefill: with the C++ kernel, torch's fused attention over the cached blocks when it
is 32 tokens or more), then one token a step (decode rows through the kernel), the true next token fed each time.
At every position the mode's next-token distribution is compared with that of the exact engine (KV cache in the
model's dtype, float32 weights): the mean KL divergence KL(exact || mode), how often both rank the same token
first, and the perplexity of the held-out text under each. The engines step in lockstep, so no distribution is
kept past its step.

    python -m benchmarks.kv_quality --model ../instrument-gpt2                  # the trained instrument
    python -m benchmarks.kv_quality --model ../instrument-gpt2 --dtype bfloat16 --modes int8-kv

Targets for an int8 cache (issue "A quantized KV cache"): KL <= 1e-3, top-1 agreement >= 99 %, perplexity within
0.5 %. A random checkpoint's near-flat distributions would show nothing: train the instrument first.
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass

import torch

from benchmarks.train_instrument import held_out, stdlib_files, token_stream
from config import EngineSettings
from generate.engine import Engine
from generate.sequence import Sequence
from generate.step_input import build_step_inputs
from model.gpt2 import StepBatch

# name -> the settings that make it; "exact" is what every other is measured against
MODES = {
    "exact": {},
    "int8-kv": dict(kv_cache_dtype="int8"),
    "fp8-kv": dict(kv_cache_dtype="fp8"),  # e4m3
    "fp8_e5m2-kv": dict(kv_cache_dtype="fp8_e5m2"),
    "int8-weights": dict(quantization="int8"),
    "int8-both": dict(kv_cache_dtype="int8", quantization="int8"),
}
DEFAULT_MODES = ("int8-kv", "int8-weights", "int8-both")


@dataclass
class Tally:
    """Sums over every position scored: each mode's against the exact engine's distribution there."""

    positions: int = 0
    kl: float = 0.0  # sum of KL(exact || mode), nats
    top1_same: int = 0
    nll: float = 0.0  # sum of -log p(true next token)
    kl_max: float = 0.0

    def add(self, exact: torch.Tensor, mode: torch.Tensor, targets: torch.Tensor) -> None:
        """exact, mode: [N, V] log-probabilities; targets: [N] the true next tokens."""
        kl = (exact.exp() * (exact - mode)).sum(-1)  # [N]
        self.positions += targets.numel()
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.top1_same += int((exact.argmax(-1) == mode.argmax(-1)).sum())
        self.nll -= float(mode.gather(1, targets[:, None]).sum())

    def summary(self, exact_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / self.positions)
        out = dict(
            positions=self.positions,
            mean_kl=self.kl / self.positions,
            max_kl=self.kl_max,
            top1_agreement=self.top1_same / self.positions,
            perplexity=ppl,
        )
        if exact_ppl is not None:
            out["perplexity_change"] = ppl / exact_ppl - 1
        return out


def held_out_windows(count: int, length: int) -> torch.Tensor:
    """`count` non-overlapping windows of length + 1 held-out tokens: [count, length + 1]."""
    tokens = token_stream([f for f in stdlib_files() if held_out(f)], count * (length + 1))
    if len(tokens) < count * (length + 1):
        raise SystemExit(f"only {len(tokens)} held-out tokens: fewer windows or shorter ones")
    return tokens.view(count, length + 1)


def engine_for(model: str, dtype: str, backend: str, blocks: int, **mode) -> Engine:
    settings = EngineSettings(
        model=model, dtype=dtype, attention_backend=backend, kv_cache_blocks=blocks, prefix_cache=False, **mode
    )
    return Engine.from_settings(settings)


def teacher_forced(engines: dict[str, Engine], windows: torch.Tensor, prefill: int):
    """Every engine over the same windows, step by step: yields (per mode [N, V] log-probabilities, [N] targets)."""
    L = windows.shape[1] - 1
    bs = next(iter(engines.values())).blocks.block_size
    per_window = -(-L // bs)
    seqs = {name: [Sequence(w[:L].tolist()) for w in windows] for name in engines}
    for chain in seqs.values():
        for b, seq in enumerate(chain):
            seq.block_table = list(range(b * per_window, (b + 1) * per_window))  # each window its own blocks
    position = 0
    while position < L:
        n = prefill if position == 0 else 1
        logprobs = {}
        for name, engine in engines.items():
            for seq in seqs[name]:
                seq.num_computed_tokens, seq.num_scheduled_tokens = position, n
            runner = engine.runner
            inputs = build_step_inputs(seqs[name], bs, runner.device)
            batch = StepBatch(
                inputs.input_ids,
                inputs.positions,
                inputs.slot_mapping,
                runner.step_attention(seqs[name], inputs.paged),
                None,
            )
            logprobs[name] = torch.log_softmax(runner.model(batch).float(), dim=-1)  # [B*n, V], row b*n + i
        targets = windows[:, position + 1 : position + n + 1].reshape(-1)  # [B*n] in the same order
        yield logprobs, targets
        position += n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained checkpoint (benchmarks/train_instrument.py)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(m for m in MODES)}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", help="ATTENTION_BACKEND of every engine")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--length", type=int, default=256, help="tokens a window")
    parser.add_argument("--prefill", type=int, default=64, help="the first chunk of each window, then one a step")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    modes = ["exact", *(m for m in args.modes.split(",") if m != "exact")]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    assert 1 <= args.prefill <= args.length

    windows = held_out_windows(args.windows, args.length)
    blocks = args.windows * -(-args.length // EngineSettings().block_size)
    engines = {m: engine_for(args.model, args.dtype, args.backend, blocks, **MODES[m]) for m in modes}
    tallies = {m: Tally() for m in modes}
    for logprobs, targets in teacher_forced(engines, windows, args.prefill):
        for m in modes:
            tallies[m].add(logprobs["exact"], logprobs[m], targets)
    exact_ppl = tallies["exact"].summary(None)["perplexity"]
    results = {m: tallies[m].summary(exact_ppl) for m in modes}
    backend = {m: e.runner.attention for m, e in engines.items()}
    print(f"{args.model}: {args.windows} held-out windows of {args.length} tokens, {args.dtype}, "
          f"first chunk {args.prefill}, attention {backend['exact']}")  # fmt: skip
    print(f"{'mode':<14}{'mean KL':>12}{'max KL':>10}{'top-1 same':>12}{'perplexity':>12}{'change':>9}")
    for m, r in results.items():
        print(f"{m:<14}{r['mean_kl']:>12.2e}{r['max_kl']:>10.2e}{r['top1_agreement']:>11.2%}"
              f"{r['perplexity']:>12.3f}{r['perplexity_change']:>+9.3%}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), attention=backend, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
