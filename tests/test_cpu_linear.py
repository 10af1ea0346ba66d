"""CPU_LINEAR: which models get oneDNN's products, and that the swap keeps the weights (and their tying)."""

import pytest
import torch

from config import EngineSettings
from model.cpu_linear import OneDNNLinear, onednn_available, use_onednn, wanted
from model.gpt2 import GPT, GPTConfig

CPU = torch.device("cpu")


def test_auto_means_onednn_in_float32_on_a_cpu_only():
    assert wanted("auto", CPU, torch.float32) is onednn_available()
    assert not wanted("auto", CPU, torch.bfloat16)  # torch already sends bfloat16 products to oneDNN
    assert not wanted("aten", CPU, torch.float32)
    assert not wanted("onednn", torch.device("cuda"), torch.float32)
    assert wanted("onednn", CPU, torch.bfloat16) is onednn_available()
    with pytest.raises(ValueError, match="CPU_LINEAR"):
        EngineSettings(cpu_linear="mkl")


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear op")
def test_the_swap_keeps_every_weight_and_the_tied_lm_head():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=100))
    model.init_random(0)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    assert use_onednn(model) == 2 * 4 + 1  # four products a layer, and the LM head
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.wte.weight
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    x = torch.randn(5, 32)
    layer = model.h[0].mlp.c_fc
    assert isinstance(layer, OneDNNLinear)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)  # float32's tolerance: another order
