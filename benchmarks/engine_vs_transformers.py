"""Greedy decoding throughput: this engine against transformers' GPT2LMHeadModel.generate.

Both run the same random weights (float32, CPU) on the same seeded prompts and generate
exactly --new-tokens tokens per prompt. The "matmul floor" is the rate of the bare weight
matrix products of one decode step (the four per-layer projections and the LM head, no
attention, no bias): a ceiling no decode step can beat.

    python -m benchmarks.engine_vs_transformers --batch-sizes 1,32
"""

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

from config import EngineSettings
from generate.engine import Engine
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams
from model.gpt2 import GPT, PRESETS
from model.loader import CONV1D_WEIGHTS, load_model
from model.tokenizer import EOT_ID

CPU = torch.device("cpu")
BLOCK_SIZE = 16
WARMUP_TOKENS = 2  # a prefill and a decode step: every code path, every shape but the cache length
FLOOR_STEPS = 5


@dataclass(frozen=True, slots=True)
class Row:
    batch: int
    engine_tps: float
    hf_tps: float
    floor_tps: float
    agreement: str


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS), help="preset, random weights")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per system; the best counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def to_transformers(model: GPT) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel holding exactly `model`'s weights."""
    c = model.config
    hf_config = GPT2Config(
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        n_positions=c.n_positions,
        vocab_size=c.vocab_size,
        layer_norm_epsilon=c.layer_norm_eps,
    )
    hf = GPT2LMHeadModel(hf_config)
    state = {
        ("" if key == "lm_head.weight" else "transformer.") + key: (w.t() if key.endswith(CONV1D_WEIGHTS) else w)
        for key, w in model.state_dict().items()
    }
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing), missing
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr(), "LM head must stay tied"
    return hf.eval()


def random_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=gen)  # [B, P]


def make_engine(model: GPT, name: str, batch: int, context: int) -> Engine:
    """An engine whose pool holds the whole batch at full length, with room for the admission watermark."""
    needed = batch * math.ceil(context / BLOCK_SIZE)
    settings = EngineSettings(
        kv_cache_blocks=needed + needed // 50 + 2,
        block_size=BLOCK_SIZE,
        max_batch_size=max(batch, 1),
        max_batch_tokens=max(1024, batch * context),
        prefix_cache=False,  # repeated prompts must not skip their prefill
    )
    runner = ModelRunner.from_settings(model, settings.kv_cache_blocks, settings)
    return Engine(runner, settings.kv_cache_blocks, settings, name, is_random=True)


def engine_generate(engine: Engine, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    return engine.generate(prompts.tolist(), SamplingParams(max_tokens=new_tokens, temperature=0))


def hf_generate(hf: GPT2LMHeadModel, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # no end token: the engine does not stop at it either
        pad_token_id=EOT_ID,
    )
    with torch.inference_mode():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    assert out.shape == (prompts.shape[0], prompts.shape[1] + new_tokens), out.shape
    return out[:, prompts.shape[1] :].tolist()


def timed(run: Callable[[int], list[list[int]]], new_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """Best wall time of `repeats` runs after a short warm-up, and the last run's tokens."""
    run(min(WARMUP_TOKENS, new_tokens))
    best, tokens = math.inf, []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run(new_tokens)
        best = min(best, time.perf_counter() - start)
    return best, tokens


@torch.inference_mode()
def matmul_floor(model: GPT, batch: int, steps: int = FLOOR_STEPS) -> float:
    """Tokens/s of one decode step's weight matmuls alone: [B, C] through every projection and the LM head."""
    projections = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))
    weights = [getattr(getattr(block, part), name).weight for block in model.h for part, name in projections]
    x = torch.randn(batch, model.config.n_embd)
    wide = torch.randn(batch, 4 * model.config.n_embd)

    def step() -> None:
        for w in weights:
            torch.mm(x if w.shape[1] == x.shape[1] else wide, w.t())
        torch.mm(x, model.lm_head.weight.t())

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """'all N agree', or how many sequences differ and the earliest position where one does."""
    diffs = [next(i for i, (x, y) in enumerate(zip(s, t)) if x != y) for s, t in zip(a, b) if s != t]
    if not diffs:
        return f"all {len(a)} agree"
    return f"{len(diffs)}/{len(a)} differ (first at token {min(diffs)})"


def bench_batch(model: GPT, hf: GPT2LMHeadModel, batch: int, args: argparse.Namespace) -> Row:
    prompts = random_prompts(batch, args.prompt_len, model.config.vocab_size, args.seed)
    engine = make_engine(model, f"random:{args.model}", batch, args.prompt_len + args.new_tokens)
    engine_s, engine_ids = timed(lambda n: engine_generate(engine, prompts, n), args.new_tokens, args.repeats)
    model.kv_cache = None  # free the engine's pool before transformers allocates its own cache
    hf_s, hf_ids = timed(lambda n: hf_generate(hf, prompts, n), args.new_tokens, args.repeats)
    generated = batch * args.new_tokens
    row = Row(batch, generated / engine_s, generated / hf_s, matmul_floor(model, batch), agreement(engine_ids, hf_ids))
    print(f"  batch {batch}: engine {engine_s:.2f} s, transformers {hf_s:.2f} s, greedy ids: {row.agreement}")
    return row


def print_table(rows: list[Row]) -> None:
    header = ("batch", "engine tok/s", "transformers tok/s", "speed-up", "floor tok/s", "engine % floor", "hf % floor")
    print(" | ".join(header))
    for r in rows:
        cells = (
            f"{r.batch:>5}",
            f"{r.engine_tps:>12.1f}",
            f"{r.hf_tps:>18.1f}",
            f"{r.engine_tps / r.hf_tps:>7.2f}x",
            f"{r.floor_tps:>11.1f}",
            f"{100 * r.engine_tps / r.floor_tps:>13.1f}%",
            f"{100 * r.hf_tps / r.floor_tps:>9.1f}%",
        )
        print(" | ".join(cells))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(f"random:{args.model}", CPU, torch.float32, seed=args.seed).model
    hf = to_transformers(model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(
        f"{args.model} (random weights, float32, {args.threads} threads, torch {torch.__version__}): "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, best of {args.repeats}"
    )
    rows = [bench_batch(model, hf, batch, args) for batch in batches]
    print_table(rows)


if __name__ == "__main__":
    main()
