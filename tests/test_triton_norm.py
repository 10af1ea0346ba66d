"""The fused residual add + LayerNorm kernel against PyTorch's two ops, and the model through it.

Without a GPU the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

import pytest
import torch
from conftest import TINY, random_prompts
from test_model import make_engine

pytest.importorskip("triton", reason="the fused kernel needs the triton package")

from generate.sequence import Sequence  # noqa: E402
from generate.step_input import build_step_inputs  # noqa: E402
from model.gpt2 import StepBatch  # noqa: E402
from model.triton_attention import TritonAttention  # noqa: E402
from model.triton_norm import add_layer_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("columns", [64, 96])  # a power of two, and one the kernel's block masks
@pytest.mark.parametrize("rows", [7, 45])  # under the interpreter a program takes 32 rows: one part-full, two
def test_add_layer_norm_equals_the_add_then_layer_norm(dtype, columns, rows):
    gen = torch.Generator().manual_seed(columns + rows)
    # off-centre and spread, so the mean and the variance both matter; x a strided view, as a slice of a wider row
    wide = (torch.randn((rows, 2 * columns), generator=gen) * 3 + 1).to(DEVICE, dtype)
    x = wide[:, columns:]  # [rows, C] with a row stride of 2C
    y = torch.randn((rows, columns), generator=gen).to(DEVICE, dtype)
    weight = (torch.rand(columns, generator=gen) + 0.5).to(DEVICE, dtype)
    bias = torch.randn(columns, generator=gen).to(DEVICE, dtype)
    total, normed = add_layer_norm(x, y, weight, bias, 1e-5)
    expected_total = x + y  # [rows, C] as the model stores the residual
    # float64 statistics over the stored sum
    expected = torch.nn.functional.layer_norm(expected_total.double(), (columns,), weight.double(), bias.double(), 1e-5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(total, expected_total, atol=tol, rtol=tol)
    torch.testing.assert_close(normed.double(), expected, atol=tol, rtol=tol)
    assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == (rows, columns)


@pytest.fixture(scope="module")
def spread_norms(tmp_path_factory):
    """The tiny checkpoint with every LayerNorm's weight and bias drawn at random (transformers initialises them
    to ones and zeros, which would hide a norm applied in the wrong place); its directory and its model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4321)
    model = GPT2LMHeadModel(GPT2Config(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in f".{name}":
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight") else torch.randn_like(p))
    directory = tmp_path_factory.mktemp("spread-norms")
    model.save_pretrained(directory)
    return directory, model


def test_logits_through_the_fused_norms_match_transformers(spread_norms):
    """The Triton backend chains each residual add with the next norm, ln_f over every row before the rows
    whose logits are wanted are picked: the logits of those rows equal transformers'."""
    checkpoint, hf_model = spread_norms
    engine = make_engine(checkpoint, attention="triton")
    (prompt,) = random_prompts([21], seed=7)
    seq = Sequence(list(prompt))
    engine.blocks.allocate(seq)
    seq.num_scheduled_tokens = len(prompt)
    inputs = build_step_inputs([seq], engine.blocks.block_size, DEVICE)
    wanted = torch.tensor([3, 20, 11], device=DEVICE)
    batch = StepBatch(inputs.input_ids, inputs.positions, inputs.slot_mapping, TritonAttention(inputs.paged), wanted)
    assert batch.attention.fused_norms
    expected = hf_model(torch.tensor([prompt])).logits[0, wanted.cpu()]  # [3, V]
    torch.testing.assert_close(engine.runner.model(batch).cpu(), expected, atol=1e-4, rtol=1e-4)
