"""Structured output's cost: 32 requests under a JSON-schema (or regex) constraint against the same 32 without.

Both runs sample at temperature 1 with the same seeds and ignore end-of-text, and the schema (an array of at least
20 objects) or the regex (at least 40 lines) cannot end within the new tokens, so both generate exactly requests x
new-tokens tokens and the only difference is the masks (and, with JUMP_FORWARD, the steps they save): filled each
step by one batched llguidance call on a worker thread while the forward pass runs, then applied in the sampler.
Runs alternate (free, constrained, free, constrained, ...) so that load from other processes falls on both alike.

With JUMP_FORWARD (the engine's default) the tokens a grammar forces are appended with the token drawn before them
and computed in the next step, so a constrained run takes fewer steps than tokens; --no-jump-forward draws each.

Prints tokens/s and steps of each run and their ratio, the step stages (forward, mask wait, sample), the mean mask-fill
time per step, and a projection for a GPU whose decode step takes --gpu-step-ms: the fill overlaps the forward
pass, so a step pays only the part of the fill longer than the step.

python -m benchmarks.structured_output --model gpt2-medium --kv-cache-gb 0.5
python -m benchmarks.structured_output --model DIR --kind regex   (a checkpoint directory, e.g. a 2-layer one)
"""

import argparse
import json
import os
import random
import statistics
import time

import torch

from config import EngineSettings
from generate.constraints import Constraint
from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["new", "used", "broken"]}, "maxItems": 3},
        "owner": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/person"}]},
    },
    "required": ["id", "name", "tags", "owner"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 20}},
    "required": ["items"],
    "additionalProperties": False,
    "$defs": {
        "person": {
            "type": "object",
            "properties": {"first": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
            "required": ["first", "age"],
            "additionalProperties": False,
        }
    },
}


REGEX = r"([a-z]{1,8} [0-9]{1,4}\n){40,}"
CONSTRAINTS = {"json_schema": Constraint("json_schema", json.dumps(SCHEMA)), "regex": Constraint("regex", REGEX)}


def run(engine: Engine, prompts: list[list[int]], new_tokens: int, constraint: Constraint | None) -> dict:
    compiled = engine.constraints.compile(constraint) if constraint else None
    seqs = [
        Sequence(list(p), SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, constraint=compiled))
        for i, p in enumerate(prompts)
    ]
    first_step, before = engine.num_steps, engine.grammar.stats.fill_s
    masked_before = engine.grammar.stats.steps
    start, first_decode = time.perf_counter(), None
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
        if first_decode is None and all(s.num_generated for s in seqs):
            first_decode = engine.num_steps + 1  # (a step computing forced tokens counts its rows as prefills)
    duration = time.perf_counter() - start
    assert all(s.num_generated == new_tokens for s in seqs), "every sequence runs to its length"
    decodes = [r for r in engine.step_log.since(first_step) if r.index >= first_decode]
    stage = lambda name: statistics.mean([r.stages.get(name, 0.0) for r in decodes] or [0.0])  # none: a short run
    masked_steps = engine.grammar.stats.steps - masked_before
    return {
        "tokens_per_s": len(seqs) * new_tokens / duration,
        "steps": engine.num_steps - first_step,
        "forward_ms": 1000 * stage("forward"),
        "mask_ms": 1000 * stage("mask"),
        "sample_ms": 1000 * stage("sample"),
        "fill_ms": 1000 * (engine.grammar.stats.fill_s - before) / masked_steps if masked_steps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium", help="a preset name (random weights), or a checkpoint dir")
    parser.add_argument("--kind", choices=sorted(CONSTRAINTS), default="json_schema")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (free, constrained)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--gpu-step-ms", type=float, default=2.0)
    parser.add_argument(
        "--no-jump-forward", dest="jump_forward", action="store_false", help="draw every token (JUMP_FORWARD=off)"
    )
    args = parser.parse_args()
    spec = args.model if os.path.isdir(args.model) else f"random:{args.model}"
    # as the server builds it (its products, glibc told to keep what a step frees), in float32, on the CPU
    settings = EngineSettings(
        model=spec, device="cpu", dtype="float32", kv_cache_gb=args.kv_cache_gb, jump_forward=args.jump_forward
    )
    engine = Engine.from_settings(settings)
    rng = random.Random(0)
    prompts = [[rng.randrange(50256) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    print(
        f"{engine.model_name} on CPU ({torch.get_num_threads()} threads), {args.requests} requests at once, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, temperature 1; means over decode steps"
    )
    print(f"{'run':<14}{'tok/s':>8}{'steps':>7}{'forward ms':>12}{'mask ms':>9}{'sample ms':>11}{'fill ms':>9}")
    results: dict[bool, list[dict]] = {False: [], True: []}
    constraint = CONSTRAINTS[args.kind]
    run(engine, prompts[:2], 4, constraint)  # warm up: the first mask fills build the lexer's tables
    for _ in range(args.rounds):
        for constrained in (False, True):
            r = run(engine, prompts, args.new_tokens, constraint if constrained else None)
            results[constrained].append(r)
            name = args.kind if constrained else "unconstrained"
            print(
                f"{name:<14}{r['tokens_per_s']:>8.1f}{r['steps']:>7}{r['forward_ms']:>12.1f}{r['mask_ms']:>9.2f}"
                f"{r['sample_ms']:>11.2f}{r['fill_ms']:>9.2f}"
            )
    mean = lambda constrained, key: statistics.mean(r[key] for r in results[constrained])
    ratio = mean(True, "tokens_per_s") / mean(False, "tokens_per_s")
    print(f"throughput, constrained / unconstrained: {ratio:.3f}x")
    # The forward pass does the same work in both runs; what the masks add is the wait for them and the
    # apply in the sample stage. Charged to the unconstrained step, that is the masks' own cost, whatever
    # other processes did to the forward pass meanwhile.
    added = mean(True, "mask_ms") + mean(True, "sample_ms") - mean(False, "sample_ms")
    step = mean(False, "forward_ms") + mean(False, "sample_ms")
    print(
        f"added per decode step: {added:.1f} ms (mask wait + apply) on a {step:.0f} ms step "
        f"-> {step / (step + added):.3f}x"
    )
    fill, threads = mean(True, "fill_ms"), torch.get_num_threads()
    print(
        f"mask fill per step ({args.requests} rows): {fill:.2f} ms on {threads} cores, overlapped with the forward pass"
    )
    for cores in (threads, 16):
        exposed = max(0.0, fill * threads / min(cores, args.requests) - args.gpu_step_ms)
        print(
            f"projection, {args.gpu_step_ms:g} ms GPU step, fill spread over {cores} host cores: {exposed:.2f} ms "
            f"exposed per step -> {args.gpu_step_ms / (args.gpu_step_ms + exposed):.3f}x (the apply: one small kernel)"
        )


if __name__ == "__main__":
    main()
