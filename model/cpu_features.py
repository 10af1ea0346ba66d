"""What the CPU computes natively, which decides the CPU's default dtype."""

import functools
from pathlib import Path

import torch

# /proc/cpuinfo's names for bfloat16 dot products (AVX-512 BF16) and matrix tiles (AMX)
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def native_bfloat16() -> bool:
    """True where the CPU multiplies bfloat16 in hardware, as oneDNN's bfloat16 kernels need: there its
    matrix products run 2-3x faster than float32's (measured on an AMD EPYC with AVX512-BF16). Elsewhere
    bfloat16 is emulated, slower than float32."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(probe is not None for probe in probes):
        return any(probe() for probe in probes)
    return bool(cpu_flags() & set(BFLOAT16_FLAGS))


def cpu_flags() -> set[str]:
    """The first processor's flags in /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())
