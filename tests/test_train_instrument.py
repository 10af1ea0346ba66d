"""benchmarks/train_instrument.py: the measuring instrument learns from the standard library's text (its held-out
loss falls far below the same model untrained), and the engine serves what it saved as transformers does."""

import json
import math

import torch
from transformers import GPT2LMHeadModel

from generate.llm import LLM
from generate.sequence import SamplingParams
from model.tokenizer import load_tokenizer
from tests.conftest import greedy_continuation


def test_the_instrument_learns_and_the_engine_serves_it(instrument_checkpoint):
    out = instrument_checkpoint  # trained with --steps 40 --batch 4 (tests/conftest.py)
    record = json.loads((out / "instrument.json").read_text())
    assert record["steps"] == 40 and record["held_out_files"] > 0
    # Untrained, a GPT-2 is near uniform over its 50,257 tokens (ln 50257 = 10.8 nats). Learning the text's token
    # frequencies alone (a unigram model of Python source) takes the loss below ~7.5 nats; 40 steps of 512 tokens
    # reach that on any machine, since the steps, not the clock, end the run (5.5 nats on a Xeon).
    assert record["untrained_held_out_loss"] > math.log(50257) - 1
    assert record["held_out_loss"] < record["untrained_held_out_loss"] - 2.5

    prompt = load_tokenizer().encode("import os\n\n\ndef main(")
    served = LLM(str(out), dtype="float32", kv_cache_blocks=64)
    tokens = served.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    reference = GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert tokens == greedy_continuation(reference, prompt, 12)
