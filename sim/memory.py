"""The simulated KV pool: what the GPUs' memory holds once the weights are loaded."""

import math

from config import EngineSettings
from kvcache.pool_size import pool_blocks
from sim.profiles import GpuProfile, ModelProfile, ProfileError

MEMORY_FRACTION = 0.9  # of device memory for weights + KV cache; the rest is activations and the runtime


def sim_kv_blocks(settings: EngineSettings, gpu: GpuProfile, model: ModelProfile, num_gpus: int) -> int:
    """Blocks of the simulated pool: KV_CACHE_BLOCKS, else KV_CACHE_GB, else 90% of memory minus the weights.

    No KV tensor exists; the number only bounds the block manager, so memory pressure,
    admission limits and preemption behave as on the simulated GPUs.
    """
    usable = MEMORY_FRACTION * gpu.memory_bytes * num_gpus
    if model.weight_bytes > usable:
        needed = math.ceil(model.weight_bytes / (MEMORY_FRACTION * gpu.memory_bytes))
        raise ProfileError(
            f"{model.name} does not fit: {model.weight_bytes / 1e9:.1f} GB of weights, "
            f"{usable / 1e9:.1f} GB usable on {num_gpus} x {gpu.name}; set SIM_NUM_GPUS to at least {needed}"
        )
    blocks = pool_blocks(settings, model.kv_bytes_per_token, usable - model.weight_bytes)
    if not (settings.kv_cache_blocks or settings.kv_cache_gb) and blocks * settings.block_size < model.context_len:
        raise ProfileError(
            f"{model.name} leaves room for {blocks * settings.block_size} tokens of KV cache on "
            f"{num_gpus} x {gpu.name}, less than one {model.context_len}-token context; raise SIM_NUM_GPUS"
        )
    return blocks
