"""How many KV blocks the pool holds: one rule for the real and the simulated engine."""

from config import Settings


def pool_blocks(settings: Settings, kv_bytes_per_token: int, default_budget_bytes: float) -> int:
    """KV_CACHE_BLOCKS, else KV_CACHE_GB, else the device's default budget, in blocks of BLOCK_SIZE tokens."""
    if settings.kv_cache_blocks:
        return settings.kv_cache_blocks
    budget = settings.kv_cache_gb * 2**30 if settings.kv_cache_gb else default_budget_bytes
    return max(1, int(budget // (kv_bytes_per_token * settings.block_size)))
