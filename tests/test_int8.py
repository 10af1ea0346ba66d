"""QUANTIZATION=int8 (model/int8_linear.py): each product within its quantization error, the model within the
accuracy docs/benchmarks.md states, a row's product the same alone or in a batch, through the engine and the
server; refused where it cannot run. float32's exactness is what tests/test_model.py checks, unchanged."""

import pytest
import torch

from benchmarks.quantization import Engine, compare, random_prompts
from config import EngineSettings
from generate.llm import LLM
from model import int8_linear
from model.int8_linear import WEIGHT_MAX, Int8Linear, activation_max

pytestmark = pytest.mark.skipif(not int8_linear.available(), reason="this torch has no oneDNN quantized linear")


@pytest.mark.parametrize("shift", [0.0, 0.5])  # rows around zero, and rows mostly above it (as GELU's outputs)
def test_each_product_is_within_its_quantization_error(shift):
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen))  # rows of all sizes
    x = (torch.randn(7, 96, generator=gen) + shift) * torch.rand(7, 1, generator=gen) * 10  # [T, in]: all sizes
    error = (Int8Linear(linear)(x) - linear(x)).abs().detach()  # [T, out]
    # rounding moves each activation by at most half its row's step, each weight by half its channel's:
    # |error| <= sum_i |x_i| dw/2 + |w_i| dx/2 + dx dw/4, with dx = its row's range (0 included) over the
    # levels less one, dw = max|w| / 127
    span = x.amax(1, keepdim=True).clamp(min=0) - x.amin(1, keepdim=True).clamp(max=0)  # [T, 1]
    dx = span / (activation_max() - 1)  # [T, 1]
    dw = linear.weight.detach().abs().amax(1) / WEIGHT_MAX  # [out]
    w_abs = linear.weight.detach().abs()  # [out, in]
    bound = x.abs() @ (dw / 2).expand(96, 40) + dx / 2 * w_abs.sum(1) + 96 * dx * dw / 4  # [T, out]
    assert (error <= bound * 1.001 + 1e-4).all()  # float32's own rounding on top
    assert error.max() > 0  # it is int8: the test would see a product left in float32


def test_int8_stays_within_the_accuracy_the_docs_state():
    # random gpt2: its real shape and initialisation, the weights docs/benchmarks.md measures
    reference = Engine(LLM("random:gpt2", dtype="float32", kv_cache_blocks=64))
    quantized = Engine(LLM("random:gpt2", quantization="int8", kv_cache_blocks=64))
    accuracy = compare(reference, quantized, random_prompts(3, 16, seed=0), 16)
    # docs/benchmarks.md, on this model with 7-bit activations (the less precise of the two): mean |delta log p|
    # of float32's tokens about 0.02, max about 0.1, top-1 about 98 %; the bounds leave room for any CPU
    assert accuracy.mean_abs_delta < 0.05 and accuracy.top1 > 0.9, accuracy
    assert accuracy.max_abs_delta < 0.3, accuracy


def test_a_row_gets_the_same_product_alone_and_in_a_batch():
    # each row has its own scale and zero point, so another row can never move its result beyond float32's
    # rounding; one scale for the whole batch (a per-tensor quantization) would move it by whole levels
    gen = torch.Generator().manual_seed(0)
    linear = Int8Linear(torch.nn.Linear(256, 96))
    x = torch.randn(33, 256, generator=gen) * torch.logspace(-2, 2, 33)[:, None]  # [T, in]: rows of all sizes
    together = linear(x)  # [T, out]
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])  # [T, out]
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5 * together.abs().amax(1, keepdim=True).min())


def test_a_server_with_int8_answers(make_app):
    app, _ = make_app(quantization="int8", dtype="float32")
    response = app.test_client().post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["usage"]["completion_tokens"] == 5


def test_int8_is_refused_where_it_cannot_run(tiny_checkpoint):
    with pytest.raises(ValueError, match="QUANTIZATION"):
        EngineSettings(quantization="int4")
    with pytest.raises(ValueError, match="QUANTIZATION=int8 runs on a CPU in float32"):
        LLM(str(tiny_checkpoint), quantization="int8", dtype="bfloat16")
