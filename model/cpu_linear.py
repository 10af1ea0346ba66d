"""The model's matrix products on a CPU through oneDNN rather than torch's default BLAS.

torch's CPU build multiplies float32 through MKL, whose kernels on AMD processors run below the AVX2 FMA
units' rate; oneDNN (also inside torch, the library vLLM's CPU linear layers use) runs a GPT-2 layer's
products and its LM head together 1.3-2.1x faster there (the LM head alone 1.5-2.2x), at 1 to 256 rows
(benchmarks/cpu_linear.py, an AMD EPYC Zen 3). Each product is still float32 in, float32 accumulated,
float32 out: only the order of the additions differs, as it does between any two BLAS libraries.

Each weight is reordered once, at load, into the blocked layout oneDNN's kernel reads, as vLLM's CPU linear
layers do: from the plain layout a decode step's products took 10-18 % longer (gpt2's 49 products with their
weights out of cache, 16 to 64 rows, Zen 3). The plain weight is then let go; the LM head's stays, as the
embedding it is tied to reads it.
"""

from collections.abc import Callable

import torch
from torch import nn

from model.cpu_features import native_bfloat16

CPU_LINEAR = ("auto", "onednn", "aten")
PACKED_FOR_ROWS = 64  # the row count oneDNN chooses the weight's layout for; it takes any count after


def onednn_available() -> bool:
    """torch's oneDNN linear op, built in (the CPU wheels have it since torch 2.0)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Module):
    """A linear layer whose product is oneDNN's, on its weight in oneDNN's own layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()  # [out, in]
        if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)  # an opaque oneDNN tensor
        self.packed = weight
        self.bias = linear.bias
        # bfloat16: GPT-2's GELU can run inside the product (gelu_after), on its float32 sums rounded once; float32
        # keeps its own GELU (model/gpt2.py), whose results transformers' greedy tokens are checked against
        self.fuses_gelu = linear.weight.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, in] -> [T, out]; "none": no fused activation after the bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def gelu_after(self, x: torch.Tensor) -> torch.Tensor:
        """GELU's tanh form on the product, as oneDNN's post-op: at 64 x 768 -> 3072 in bfloat16 0.45 ms against
        0.38 + 0.36 apart, at 1,024 rows 7.4 against 3.5 + 5.6 (Xeon Sapphire Rapids, one thread)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], "tanh")  # [T, out]


def wanted(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CPU_LINEAR=`setting` routes this model's products through oneDNN. auto: on a CPU in float32 (the
    dtype torch gives MKL), and in bfloat16 where the CPU multiplies it (elsewhere oneDNN has no kernel). torch
    already multiplies bfloat16 through oneDNN, but on the plain weight, reordered for its kernel at every
    product: the 64-request burst went 423-424 -> 481-508 out tok/s with the weights reordered once (offline
    engine, gpt2, alternated, Xeon Sapphire Rapids with AMX)."""
    assert setting in CPU_LINEAR, setting
    if device.type != "cpu" or setting == "aten" or not onednn_available():
        return False
    return setting == "onednn" or dtype == torch.float32 or (dtype == torch.bfloat16 and native_bfloat16())


def use_onednn(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a OneDNNLinear, in place: how many."""
    return replace_linears(model, OneDNNLinear)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Each nn.Linear of `model` replaced by `make(it)`, in place (a tied weight stays with the module that ties
    it; the replacement holds its own copy): how many."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return len(names)
