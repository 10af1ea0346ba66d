"""How many KV blocks the pool holds: one rule for the real and the simulated engine."""

import os

import torch

from config import EngineSettings

CPU_BUDGET_BYTES = 4 * 2**30  # vLLM's CPU backend reserves 4 GB by default too
CPU_MEMORY_SHARE = 0.5  # of the memory available at start: the weights, the server and the OS need the rest
GPU_MEMORY_SHARE = 0.9  # of the GPU's free memory, after the weights are loaded


def pool_blocks(settings: EngineSettings, kv_bytes_per_token: int, default_budget_bytes: float) -> int:
    """KV_CACHE_BLOCKS, else KV_CACHE_GB, else the device's default budget, in blocks of BLOCK_SIZE tokens."""
    if settings.kv_cache_blocks:
        return settings.kv_cache_blocks
    budget = settings.kv_cache_gb * 2**30 if settings.kv_cache_gb else default_budget_bytes
    return max(1, int(budget // (kv_bytes_per_token * settings.block_size)))


def default_budget_bytes(device: torch.device) -> float:
    """The pool's size when neither KV_CACHE_BLOCKS nor KV_CACHE_GB is set: 90 % of a GPU's free memory;
    on a CPU 4 GB, or half the memory available if that is less. A CPU pool is address space until its
    blocks are first written (model.attention.paged_cache), so a light load keeps a small footprint."""
    if device.type == "cuda":
        return GPU_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]
    return min(CPU_BUDGET_BYTES, CPU_MEMORY_SHARE * available_memory_bytes())


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
