"""int8 weights on a CPU (QUANTIZATION=int8): every matrix product of the model, the LM head's too, in int8
through oneDNN's quantized linear, the kernel torch's own x86 int8 path (Inductor's) calls.

Weights are quantized once, symmetric, one scale per output channel (max |w| / 127), and packed once into
oneDNN's layout. Activations are quantized at every product, one scale and zero point per token (row), over
the row's own range (asymmetric: GELU's outputs, nearly all above -0.17, get the levels a symmetric range
would spend on negatives): a row's product never depends on the other rows of the step (its tokens still may:
the float32 around the products rounds with a step's shape, and a quantization level can turn that into a
different token; docs/reproducibility.md). The kernel takes one activation scale and zero point per call, so each row
is divided by its own scale first (its values land on whole numbers) and quantized with scale 1 and zero point
0; the row's zero point comes off after the product (sum_i (q_i - z) w_i = sum_i q_i w_i - z sum_i w_i) and
its scale multiplies the result. The int32 sums are exact.

How many levels an activation gets depends on the CPU. Without VNNI (AVX2; AVX-512 without it) the kernel
multiplies unsigned 8-bit activations by signed 8-bit weights in pairs summed in 16 bits, which full-range
activations overflow; there activations get 7 bits (0..127), as torch's own dynamic quantization narrows them
on x86. Where a probe at load finds full-range products exact (VNNI's dot products sum into 32 bits), they
get 8 (0..255).
"""

import functools

import torch
from torch import nn

from model.cpu_linear import replace_linears

WEIGHT_MAX = 127  # int8 weights: -127..127


def available() -> bool:
    """oneDNN's quantized linear, built into torch's CPU wheels (used by Inductor's x86 int8 path)."""
    ops = torch.ops.onednn
    return (
        torch.backends.mkldnn.is_available() and hasattr(ops, "qlinear_prepack") and hasattr(ops, "qlinear_pointwise")
    )


def _product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """sum_i x[t, i] * w[o, i] * scales[o] in float32, x unsigned 8-bit, the weights' zero points `zeros` (all 0):
    [T, in] -> [T, out]."""
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, 0, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )


@functools.cache
def activation_max() -> int:
    """The largest unsigned activation: 255 where full-range activations times full-range weights come out exact
    on this CPU, else 127. The probe puts the largest products side by side, as a 16-bit pair sum overflows on
    them, at one row and at many (oneDNN may pick another kernel for each)."""
    weight = torch.full((16, 256), WEIGHT_MAX, dtype=torch.int8)  # [out, in]
    for rows in (1, 64):
        x = torch.full((rows, 256), 255, dtype=torch.uint8)  # [T, in]
        packed = torch.ops.onednn.qlinear_prepack(weight, [rows, 256])
        got = _product(x, packed, torch.ones(16), torch.zeros(16, dtype=torch.long))  # [T, out]
        if not bool((got == 255 * WEIGHT_MAX * 256).all()):
            return 127
    return 255


class Int8Linear(nn.Module):
    """A linear layer's product in int8 (its weight quantized once) plus its float32 bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.scales = (weight.abs().amax(dim=1) / WEIGHT_MAX).clamp(min=1e-12)  # [out]
        quantized = torch.round(weight / self.scales[:, None]).to(torch.int8)  # [out, in]
        self.sums = quantized.sum(dim=1).float() * self.scales  # [out]: each channel's weights, scaled as the kernel
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)  # oneDNN's layout, once
        self.zeros = torch.zeros(weight.shape[0], dtype=torch.long)  # [out]: symmetric weights
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # [out]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.levels = activation_max()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [T, in]
        low = rows.amin(dim=1, keepdim=True).clamp(max=0)  # [T, 1]
        high = rows.amax(dim=1, keepdim=True).clamp(min=0)  # [T, 1]
        # one level short of the range, so that round(x / scale) + zero never passes it: no value is clamped
        scale = ((high - low) / (self.levels - 1)).clamp(min=1e-12)  # [T, 1]
        zero = torch.round(-low / scale)  # [T, 1]: where 0 lands
        quantized = torch.round(rows / scale).add_(zero).clamp_(0, self.levels).to(torch.uint8)  # [T, in]
        # sum_i (q_i - zero) w_i = sum_i q_i w_i - zero sum_i w_i: the kernel computes the first with zero point 0
        y = _product(quantized, self.packed, self.scales, self.zeros).sub_(zero * self.sums)  # [T, out]
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)  # [T, out]
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize(model: nn.Module) -> int:
    """Replace every linear layer of `model` by an Int8Linear, in place (a tied LM head gets its own int8 copy;
    the embedding keeps its float weights): how many."""
    assert available(), "this torch has no oneDNN quantized linear"
    return replace_linears(model, Int8Linear)
