"""The model's matrix products on a CPU through oneDNN rather than torch's default BLAS.

torch's CPU build multiplies float32 through MKL, whose kernels on AMD processors run below the AVX2 FMA
units' rate; oneDNN (also inside torch, the library vLLM's CPU linear layers use) runs a GPT-2 layer's
products and its LM head together 1.3-2.1x faster there (the LM head alone 1.5-2.2x), at 1 to 256 rows
(benchmarks/cpu_linear.py, an AMD EPYC Zen 3). Each product is still float32 in, float32 accumulated,
float32 out: only the order of the additions differs, as it does between any two BLAS libraries.
"""

import torch
from torch import nn

CPU_LINEAR = ("auto", "onednn", "aten")


def onednn_available() -> bool:
    """torch's oneDNN linear op, built in (the CPU wheels have it since torch 2.0)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Linear):
    """nn.Linear whose product is oneDNN's; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, in] -> [T, out]; "none": no fused activation after the bias
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def wanted(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CPU_LINEAR=`setting` routes this model's products through oneDNN. auto: on a CPU in float32,
    the dtype MKL serves (bfloat16 and float16 products already go to oneDNN inside torch)."""
    assert setting in CPU_LINEAR, setting
    if device.type != "cpu" or setting == "aten" or not onednn_available():
        return False
    return setting == "onednn" or dtype == torch.float32


def use_onednn(model: nn.Module) -> int:
    """Turn every nn.Linear of `model` into a OneDNNLinear, in place (weights untouched, shared ones still
    shared): how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for module in linears:
        module.__class__ = OneDNNLinear
    return len(linears)
