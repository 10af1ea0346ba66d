"""The engine without the server: a batch of prompts through the same scheduler and KV cache.

MODEL as the server takes it (default: gpt2-medium, or random weights where it cannot be downloaded).
"""

import os

from generate.llm import LLM, SamplingParams

llm = LLM(os.environ.get("MODEL", ""))
prompts = ["The lighthouse keeper", "Once upon a time, in a small village,", "The capital of France is"]
params = SamplingParams(temperature=0, max_tokens=32, stop_at_eos=True)  # greedy, ending at end-of-text
for out in llm.generate(prompts, params):
    completion = out.outputs[0]
    print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
