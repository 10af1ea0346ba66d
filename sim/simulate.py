"""Predict a request's latency from a GPU profile and a model profile, with the engine's cost model.

`batch` identical requests admitted together: one step prefills all their prompts and
samples each one's first token, then every further token is one decode step of the whole
batch at a context one longer than the last. (The engine does exactly this when
MAX_BATCH_TOKENS covers batch x prompt tokens and nothing else is running.)

    python -m sim.simulate --gpu a100-80gb --model llama-65b --num-gpus 2 --prompt 512 --response 128 --batch 8
    python -m sim.simulate --gpu profiles/cpu.toml --model gpt2 --dtype float32 --prompt 128 --response 64 --batch 4
"""

import argparse
from typing import NamedTuple

from sim.cost import step_cost
from sim.profiles import DTYPE_BYTES, GpuProfile, ModelProfile, load_gpu, load_model


class Prediction(NamedTuple):
    prefill_s: float  # the first step: all prompts, and each request's first token
    decode_s: list[float]  # each later token's step, in order
    total_s: float  # end-to-end latency of every request in the batch


def simulate(
    gpu: GpuProfile, model: ModelProfile, prompt_len: int, response_len: int, batch_size: int, num_gpus: int = 1
) -> Prediction:
    assert prompt_len >= 1 and response_len >= 1 and batch_size >= 1
    assert prompt_len + response_len <= model.context_len, "longer than the model's context"
    prefill = step_cost(gpu, model, [(prompt_len, prompt_len)] * batch_size, num_gpus).total_s
    # decode step i computes the KV of generated token i, at context prompt_len + i
    decode = [
        step_cost(gpu, model, [(1, prompt_len + i)] * batch_size, num_gpus).total_s for i in range(1, response_len)
    ]
    return Prediction(prefill, decode, prefill + sum(decode))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="a100-80gb", help="a name in sim/gpus.toml or a profile file")
    parser.add_argument("--model", default="llama-65b", help="a name in sim/models.toml")
    parser.add_argument("--num-gpus", type=int, default=1, help="tensor-parallel GPUs")
    parser.add_argument("--dtype", default="", choices=["", *DTYPE_BYTES], help="default: the model's (fp16)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--response", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--batch", type=int, default=1, help="identical requests admitted together")
    args = parser.parse_args()
    gpu, model = load_gpu(args.gpu), load_model(args.model, args.dtype)
    p = simulate(gpu, model, args.prompt, args.response, args.batch, args.num_gpus)
    kv_gb = args.batch * (args.prompt + args.response) * model.kv_bytes_per_token / 1e9
    print(
        f"{model.name} ({model.num_params / 1e9:.2f} B params, {model.weight_bytes / 1e9:.1f} GB) on "
        f"{args.num_gpus} x {gpu.name}: batch {args.batch}, {args.prompt}-token prompts, {args.response} tokens each"
    )
    prompt_rate = args.batch * args.prompt / p.prefill_s
    print(f"prefill (TTFT)    {p.prefill_s * 1e3:10.2f} ms  ({prompt_rate:,.0f} prompt tok/s)")
    if p.decode_s:
        first, last, mean = p.decode_s[0], p.decode_s[-1], sum(p.decode_s) / len(p.decode_s)
        print(f"decode per token  {first * 1e3:10.2f} ms first, {last * 1e3:.2f} ms last, {mean * 1e3:.2f} mean")
    print(f"end-to-end        {p.total_s * 1e3:10.2f} ms  ({args.batch * args.response / p.total_s:,.1f} output tok/s)")
    print(f"KV cache of the batch at the end: {kv_gb:.2f} GB")


if __name__ == "__main__":
    main()
