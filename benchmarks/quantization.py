"""int8 against float32 on the same random weights: this server's QUANTIZATION=int8, and llama.cpp's Q8_0
beside it when --llama-server is given, each against this server's float32 (transformers' float32 to the token).

Teacher-forced: float32's greedy continuation of each prompt is fed to the quantized model, and every
continuation token's log-probability under it is compared with float32's (mean and max |delta|), with how often
its likeliest token is float32's choice (top-1); then free-running: how many of its own greedy continuations
equal float32's token for token, and for how many tokens from the start they agree on average. llama-server
gives no prompt log-probabilities, so it is asked one position at a time (a prompt and one token, its top
TOP_N log-probabilities before sampling), its prompt cache making each step one token long. llama.cpp's f32
GGUF is measured the same way, as the comparison's own floor. Speed is the peer benchmark's
(`python -m benchmarks.peers --systems ours,llama-q8_0 --server-env QUANTIZATION=int8`).

python -m benchmarks.quantization --model gpt2 --prompts 16 --new-tokens 64
python -m benchmarks.quantization --model gpt2-medium --llama-server ../llama/bin/llama-server --llama-src SRC
"""

import argparse
import os
import random
import statistics
from pathlib import Path
from typing import NamedTuple, Protocol

import requests

from benchmarks import llama_server
from benchmarks.gguf_files import prepare, write_hf_checkpoint
from client.launch import stop_server
from generate.llm import LLM, SamplingParams
from model.cpu_features import cpu_flags

TOP_N = 100  # llama-server's log-probabilities per position: float32's token is among them but for a miss


class Scored(NamedTuple):
    logprob: float | None  # the given token's log-probability (None: not among llama-server's TOP_N)
    top: int  # the likeliest token in its place


class Model(Protocol):
    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]: ...

    def score(self, text: list[int], start: int) -> list[Scored]:
        """For each token of `text` from index `start` on: its log-probability given the tokens before it."""
        ...


class Accuracy(NamedTuple):
    mean_abs_delta: float  # mean |log p_quantized - log p_float32| over float32's chosen tokens
    max_abs_delta: float
    top1: float  # share of positions where the quantized model's likeliest token is float32's choice
    equal_continuations: int  # free-running greedy continuations equal token for token
    mean_agreeing_prefix: float  # tokens from the start on which they agree, on average
    misses: int  # positions without a log-probability (llama-server's TOP_N lacked float32's token)


class Engine:
    """This server's engine (generate.llm.LLM) as a Model."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, stop_at_eos=False)
        return [out.outputs[0].token_ids for out in self.llm.generate(prompts, params)]

    def score(self, text: list[int], start: int) -> list[Scored]:
        out = self.llm.generate([text], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        return [Scored(lp.logprob, lp.top[0][0]) for lp in out.prompt_logprobs[start - 1 :]]  # entry i: token i + 1


class LlamaServer:
    """A running llama-server as a Model, through its native /completion."""

    def __init__(self, url: str):
        self.url = url

    def _complete(self, prompt: list[int], n_predict: int, n_probs: int = 0) -> dict:
        body = {"prompt": prompt, "n_predict": n_predict, "n_probs": n_probs, "temperature": 0.0}
        body |= {"ignore_eos": True, "return_tokens": True, "cache_prompt": True}
        response = requests.post(f"{self.url}/completion", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return [self._complete(prompt, new_tokens)["tokens"] for prompt in prompts]

    def score(self, text: list[int], start: int) -> list[Scored]:
        scored = []
        for end in range(start, len(text)):
            entry = self._complete(text[:end], 1, TOP_N)["completion_probabilities"][0]
            logprobs = {top["id"]: top["logprob"] for top in entry["top_logprobs"]}
            scored.append(Scored(logprobs.get(text[end]), entry["top_logprobs"][0]["id"]))
        return scored


def compare(reference: Model, quantized: Model, prompts: list[list[int]], new_tokens: int) -> Accuracy:
    """`quantized` against `reference` (float32) on `prompts`, each continued by `new_tokens`."""
    ours = reference.greedy(prompts, new_tokens)
    deltas, same_top, misses = [], [], 0
    for prompt, continuation in zip(prompts, ours):
        text, start = prompt + continuation, len(prompt)
        for ref, q, token in zip(reference.score(text, start), quantized.score(text, start), continuation):
            same_top.append(q.top == token)
            if q.logprob is None:
                misses += 1
            else:
                deltas.append(abs(q.logprob - ref.logprob))
    theirs = quantized.greedy(prompts, new_tokens)
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return Accuracy(
        statistics.fmean(deltas),
        max(deltas),
        statistics.fmean(same_top),
        sum(x == y for x, y in zip(ours, theirs)),
        statistics.fmean(prefixes),
        misses,
    )


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50256) for _ in range(length)] for _ in range(count)]


def report(name: str, acc: Accuracy, prompts: int, new_tokens: int) -> str:
    misses = f", {acc.misses} positions outside its top {TOP_N}" if acc.misses else ""
    return (
        f"| {name} | {acc.mean_abs_delta:.4f} | {acc.max_abs_delta:.4f} | {acc.top1:.1%} | "
        f"{acc.equal_continuations}/{prompts} | {acc.mean_agreeing_prefix:.1f} of {new_tokens}{misses} |"
    )


def llama_rows(args: argparse.Namespace, reference: Model, prompts: list[list[int]], work_dir: Path) -> list[str]:
    """llama.cpp's f32 and Q8_0 GGUF of the same checkpoint, each against `reference`."""
    _, ggufs = prepare(args.model, args.seed, work_dir, args.llama_src, ("f32", "q8_0"))
    rows = []
    for out_type, gguf in ggufs.items():
        proc, url, _ = llama_server.start(args.llama_server, gguf, work_dir, args.threads, ["--parallel", "1"])
        try:
            acc = compare(reference, LlamaServer(url), prompts, args.new_tokens)
        finally:
            stop_server(proc)
        rows.append(report(f"llama.cpp {out_type.upper()} GGUF", acc, args.prompts, args.new_tokens))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="random weights of this preset: gpt2, gpt2-medium...")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (benchmarks.peers' default too)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--llama-server", type=Path, help="also measure llama.cpp's Q8_0 (and f32) GGUF")
    parser.add_argument("--llama-src", type=Path, help="llama.cpp's source: its converter makes the GGUF files")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t (default: all cores)")
    parser.add_argument("--work-dir", type=Path, default=Path("results/peers/checkpoints"), help="as benchmarks.peers")
    args = parser.parse_args()
    prompts = random_prompts(args.prompts, args.prompt_tokens, args.seed)
    hf_dir = write_hf_checkpoint(args.model, args.seed, args.work_dir / f"{args.model}-seed{args.seed}" / "hf")
    reference = Engine(LLM(str(hf_dir), dtype="float32"))
    rows = [
        report(
            "this server, QUANTIZATION=int8",
            compare(reference, Engine(LLM(str(hf_dir), quantization="int8")), prompts, args.new_tokens),
            args.prompts,
            args.new_tokens,
        )
    ]
    if args.llama_server:
        if (missing := llama_server.missing_binary(args.llama_server)) is not None:
            parser.error(missing)
        rows += llama_rows(args, reference, prompts, args.work_dir)
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni") if f in cpu_flags())
    print(
        f"random {args.model} (seed {args.seed}): {args.prompts} prompts of {args.prompt_tokens} random tokens, "
        f"{args.new_tokens} new; against this server's float32; CPU flags: {flags}"
    )
    print("\n| int8 | mean abs delta log p | max | top-1 | equal continuations | agreeing tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
