"""The live table's per-tenant rows (fair share, generate/fair_share.py), labelled `tenant`: at most
MAX_LABELS tenants by name, the rest as "other"; the shared tenant (requests that name none) as "shared"."""

from typing import TYPE_CHECKING

from batching.live_value import LiveValue

if TYPE_CHECKING:
    from batching.live import LiveTable


def _ledger(t: "LiveTable"):
    return t.engine.scheduler.fair.ledger


def _tally(t: "LiveTable", queue: str) -> dict[str, int]:
    return _ledger(t).tally([s.tenant for s in list(getattr(t.engine.scheduler, queue))])


TENANT_VALUES = (
    LiveValue(
        "tenant_prompt_tokens",
        "gpt2_tenant_prompt_tokens",
        "counter",
        "Prompt tokens computed for each tenant (prefix-cache hits and recomputation are not counted)",
        lambda t: _ledger(t).read(_ledger(t).prompt_tokens),
        label="tenant",
    ),
    LiveValue(
        "tenant_generated_tokens",
        "gpt2_tenant_generated_tokens",
        "counter",
        "Tokens generated for each tenant",
        lambda t: _ledger(t).read(_ledger(t).generated_tokens),
        label="tenant",
    ),
    LiveValue(
        "tenant_requests_running",
        "gpt2_tenant_requests_running",
        "gauge",
        "Each tenant's sequences in the running batch",
        lambda t: _tally(t, "running"),
        label="tenant",
    ),
    LiveValue(
        "tenant_requests_waiting",
        "gpt2_tenant_requests_waiting",
        "gauge",
        "Each tenant's sequences in the scheduler's queue",
        lambda t: _tally(t, "waiting"),
        label="tenant",
    ),
    LiveValue(
        "tenant_requests_refused",
        "gpt2_tenant_requests_refused",
        "counter",
        "Requests refused at admission, by tenant (any reason: requests_refused has the reasons)",
        lambda t: _ledger(t).read(_ledger(t).refused),
        label="tenant",
    ),
)
