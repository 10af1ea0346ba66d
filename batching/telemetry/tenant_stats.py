"""The live table's per-tenant rows (fair share, generate/fair_share.py), labelled `tenant`: at most
MAX_LABELS tenants by name, the rest as "other"; the shared tenant (requests that name none) as "shared".
Each row is `tenant_<what>` in /stats and `gpt2_tenant_<what>` in /metrics, and shows the engine's counter of
that name (generate/engine_counters.py). A reader shown only some tenants (a tenant's key sees its own:
api/stats.py) gets the rows with the others' labels left out."""

from dataclasses import dataclass

from batching.telemetry.live_value import LiveValue, Reading

ROWS = (
    ("prompt_tokens", "counter", "Prompt tokens computed for each tenant (cache hits, recomputation not counted)"),
    ("generated_tokens", "counter", "Tokens generated for each tenant"),
    ("requests_running", "gauge", "Each tenant's sequences in the running batch"),
    ("requests_waiting", "gauge", "Each tenant's sequences in the scheduler's queue"),
    (
        "requests_refused",
        "counter",
        "Requests refused at admission, by tenant (any reason; requests_refused by reason)",
    ),
)
TENANT_VALUES = tuple(
    LiveValue(f"tenant_{what}", f"gpt2_tenant_{what}", kind, help, label="tenant") for what, kind, help in ROWS
)
TENANT_KEYS = frozenset(row.key for row in TENANT_VALUES)


@dataclass(frozen=True, slots=True)
class TenantView:
    """Which tenants a reader sees the figures and request events of: every one (the operator's view), or only
    its own `tenant` (None: no tenant's)."""

    every: bool = True
    tenant: str | None = None

    def shows(self, tenant: str) -> bool:
        return self.every or (self.tenant is not None and tenant == self.tenant)

    def shows_label(self, label: str, labels: dict[str, str]) -> bool:
        """A label it may see, given each tenant's `labels`: "other", which several tenants share, only in the
        operator's view."""
        return self.every or (self.tenant is not None and label == labels.get(self.tenant))


EVERY_TENANT = TenantView()


def only_shown(values: dict[str, Reading], view: TenantView, labels: dict[str, str]) -> dict[str, Reading]:
    """The live values with each per-tenant row cut to the labels the view shows."""
    if view.every:
        return values
    shown = lambda row: {label: n for label, n in row.items() if view.shows_label(label, labels)}  # noqa: E731
    return {key: shown(value) if key in TENANT_KEYS else value for key, value in values.items()}
