"""Greedy output in float16 and bfloat16 against transformers in float32.

Half precision cannot be equal to the token: where float32's two likeliest tokens are nearly
tied, a rounding can swap them, and the continuations part there. So a sequence must either
equal the float32 reference, or part from it only at a token where the reference's lead over
the engine's choice is no larger than the rounding error of transformers' own model in that
dtype at that point (the largest difference of its logits from float32's). A wrong position,
key or block shows up as a parting where the reference was sure of its token.

On a machine with a GPU this runs the engine as the server would (the Triton kernel and CUDA
graphs); on CPU, the reference attention.
"""

import pytest
import torch
from conftest import random_prompts

from config import Settings
from generate.engine import Engine
from generate.sequence import SamplingParams

NUM_TOKENS = 40


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_parts_from_float32_only_where_rounding_could(tiny_checkpoint, hf_model, hf_greedy, dtype):
    from transformers import GPT2LMHeadModel

    engine = Engine.from_settings(
        Settings(model=str(tiny_checkpoint), dtype=dtype, block_size=4, kv_cache_blocks=512, max_batch_tokens=24)
    )
    hf_half = GPT2LMHeadModel.from_pretrained(tiny_checkpoint).to(getattr(torch, dtype)).eval()
    (prefix,) = random_prompts([9], seed=41)  # shared by half the prompts: read from the prefix cache
    prompts = random_prompts([1, 7, 30, 64, 100, 200], seed=42) + random_prompts([3, 20, 50], seed=43, prefix=prefix)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0))
    assert engine.scheduler.prompt_tokens_cached > 0

    for prompt, output in zip(prompts, outputs):
        reference = hf_greedy(prompt, NUM_TOKENS)
        at = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), None)
        if at is None:
            continue
        context = torch.tensor([prompt + reference[:at]])
        with torch.no_grad():
            exact = hf_model(context).logits[0, -1]  # [V]
            rounded = hf_half(context).logits[0, -1].float()  # [V]
        lead = (exact[reference[at]] - exact[output[at]]).item()
        rounding = (rounded - exact).abs().max().item()
        assert lead <= rounding, (
            f"{dtype}: a {len(prompt)}-token prompt parts from float32 at token {at}, where float32 led by "
            f"{lead:.4f} ({lead / exact[reference[at]].abs().item():.1e} of its logit); transformers' own "
            f"{dtype} logits are off by at most {rounding:.4f} there"
        )
