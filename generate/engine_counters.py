"""The engine's named counters in one snapshot: the one place that reads them out of the engine's parts (its
scheduler, block manager, fair-share ledger, constraint compiler and grammar masks), so that what reports them
(batching/telemetry/) reads fields of a plain value, never a chain into the engine.

A snapshot holds numbers, strings and {label: count} dicts alone, a msgspec Struct: it can leave the engine's
process as it is (msgspec.msgpack.encode, and decode with `type=EngineCounters`). Each field is named after the
/stats key of the live value that shows it (batching/telemetry/live.py); `tenant_labels` is what a reader shown
only its own tenant needs to pick that tenant's rows.
"""

from typing import TYPE_CHECKING

import msgspec

from generate.fair_share import SHARED, SHARED_LABEL

if TYPE_CHECKING:
    from generate.engine import Engine


class EngineCounters(msgspec.Struct, frozen=True, array_like=True):
    # the scheduler's queues
    requests_running: int  # sequences in the running batch
    # the paged KV cache (kvcache/block_manager.py)
    kv_blocks_used: int  # referenced by sequences
    kv_blocks_total: int  # the pool
    kv_blocks_cached: int  # held by the prefix cache
    kv_blocks_evictable: int  # cached, referenced by none
    kv_blocks_free: int  # can be handed out, evictable included
    evictions: int  # cached blocks evicted
    # the scheduler's since-start counts
    preemptions: int
    prefix_cache_hit_tokens: int  # admitted prompt tokens found in the prefix cache
    prefix_cache_query_tokens: int  # prompt tokens admitted
    steps: int  # engine steps run
    # structured output (generate/constraint_compiler.py, generate/grammar_mask.py)
    constrained_requests: int
    constraint_compiles: int
    constraint_cache_hits: int
    constraint_compile_mean_s: float
    constraint_compile_p99_s: float
    mask_fill_mean_s: float
    mask_wait_mean_s: float
    # fair share's ledger (generate/fair_share.py), by tenant label
    tenant_prompt_tokens: dict[str, int]
    tenant_generated_tokens: dict[str, int]
    tenant_requests_running: dict[str, int]
    tenant_requests_waiting: dict[str, int]
    tenant_requests_refused: dict[str, int]
    tenant_labels: dict[str, str]  # tenant -> its label, for every tenant whose label one of the rows above shows


def counters(engine: "Engine") -> EngineCounters:
    """The engine's counters now; from any thread (each list is copied whole before it is walked)."""
    scheduler, blocks = engine.scheduler, engine.blocks
    ledger = scheduler.fair.ledger
    compiles, masks = engine.constraints.stats(), engine.grammar.stats
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    by_tenant = {
        "tenant_prompt_tokens": ledger.read(ledger.prompt_tokens),
        "tenant_generated_tokens": ledger.read(ledger.generated_tokens),
        "tenant_requests_running": ledger.tally([s.tenant for s in running]),
        "tenant_requests_waiting": ledger.tally([s.tenant for s in waiting]),
        "tenant_requests_refused": ledger.read(ledger.refused),
    }
    # A tenant's label is its own name (the shared tenant's: "shared"), so the tenants whose labels the rows show
    # are among those names; the ledger says which of them hold that label (a tenant past the cap holds none).
    shown = {label for row in by_tenant.values() for label in row}
    tenants = shown | ({SHARED} if SHARED_LABEL in shown else set())
    labels = {tenant: label for tenant in tenants if (label := ledger.label_of(tenant)) is not None}
    return EngineCounters(
        requests_running=len(running),
        kv_blocks_used=blocks.num_used_blocks,
        kv_blocks_total=blocks.num_blocks,
        kv_blocks_cached=blocks.num_cached_blocks,
        kv_blocks_evictable=blocks.num_evictable_blocks,
        kv_blocks_free=blocks.num_free_blocks,
        evictions=blocks.evictions,
        preemptions=scheduler.num_preemptions,
        prefix_cache_hit_tokens=scheduler.prompt_tokens_cached,
        prefix_cache_query_tokens=scheduler.prompt_tokens_admitted,
        steps=engine.num_steps,
        constrained_requests=masks.constrained_requests,
        constraint_compiles=compiles.compiles,
        constraint_cache_hits=compiles.cache_hits,
        constraint_compile_mean_s=compiles.mean_s,
        constraint_compile_p99_s=compiles.p99_s,
        mask_fill_mean_s=masks.mean_fill_s(),
        mask_wait_mean_s=masks.mean_wait_s(),
        **by_tenant,
        tenant_labels=labels,
    )
