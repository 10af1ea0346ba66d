"""CPU_LINEAR: which models get oneDNN's products, and that the swap keeps every product (and the embedding)."""

import pytest
import torch

from config import EngineSettings
from model.cpu_features import native_bfloat16
from model.cpu_linear import OneDNNLinear, onednn_available, use_onednn, wanted
from model.gpt2 import GPT, GPTConfig

CPU = torch.device("cpu")


def test_auto_means_onednn_in_float32_and_bfloat16_on_a_cpu_only():
    assert wanted("auto", CPU, torch.float32) is onednn_available()
    assert wanted("auto", CPU, torch.bfloat16) is (onednn_available() and native_bfloat16())  # else no kernel
    assert not wanted("auto", CPU, torch.float16)
    assert not wanted("aten", CPU, torch.float32)
    assert not wanted("onednn", torch.device("cuda"), torch.float32)
    assert wanted("onednn", CPU, torch.bfloat16) is onednn_available()
    with pytest.raises(ValueError, match="CPU_LINEAR"):
        EngineSettings(cpu_linear="mkl")


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear op")
def test_the_swap_keeps_every_product_and_lets_the_plain_weights_go():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=100))
    model.init_random(0)
    linears = {name: (m.weight.clone(), m.bias) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    embedding = model.wte.weight.clone()
    assert use_onednn(model) == len(linears) == 2 * 4 + 1  # four products a layer, and the LM head
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    for name, (weight, bias) in linears.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, OneDNNLinear)
        wide = torch.randn(5, weight.shape[1])
        expected = wide @ weight.T + (0 if bias is None else bias)
        torch.testing.assert_close(layer(wide), expected)  # float32's tolerance: another order of additions
    assert torch.equal(model.wte.weight, embedding)  # the embedding still reads the LM head's plain weight
    weights = {name for name in model.state_dict() if name.endswith(".weight")}  # the plain product weights went:
    assert all(name.startswith(("wte.", "wpe.", "ln_f.")) or ".ln_" in name for name in weights), weights  # norms


@pytest.mark.skipif(not (onednn_available() and native_bfloat16()), reason="no oneDNN bfloat16 products here")
def test_a_bfloat16_mlp_takes_gelu_inside_its_product_and_keeps_its_values():
    """oneDNN's GELU post-op against GPT-2's GELU in float64 on the same bfloat16 product: within the half ulp of
    bfloat16 that rounding its result costs (2^-9 relative), and a little more for the sums' rounding."""
    from model.gpt2 import gelu_new

    linear = torch.nn.Linear(64, 256).to(torch.bfloat16)
    layer = OneDNNLinear(linear)
    assert layer.fuses_gelu and not OneDNNLinear(torch.nn.Linear(4, 4)).fuses_gelu  # float32 keeps its own
    x = torch.randn(9, 64).to(torch.bfloat16)
    product = x.double() @ linear.weight.double().T + linear.bias.double()
    torch.testing.assert_close(layer.gelu_after(x).double(), gelu_new(product), rtol=2**-8, atol=2**-8)
