"""Who a request is from, for fair share between tenants (generate/fair_share.py, docs/fairness.md):

  the tenant of its API key, when API_KEYS_FILE is set and the key is in it;
  else the request's `user` field (OpenAI's end-user id; /inference takes it too);
  else the shared tenant.

The keys file (TOML, or JSON of the same shape when its name ends in .json) names each tenant's keys,
and optionally its weight and admission limits:

    [tenants.search]
    keys = ["sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8", "a-plain-key"]
    weight = 2          # twice the share of a weight-1 tenant when both are backlogged
    max_waiting = 64    # more waiting is refused with 429 (tenant_max_waiting)
    max_running = 16    # a request arriving while this many run is refused with 429 (tenant_max_running)

    admin = true        # the operator: LoRA loading, every tenant's figures and batches (docs/operations.md)
    min_priority = -10  # the most urgent `priority` its requests may ask for (default 0)

A key written "sha256:<hex>" is stored as that hash; any other is hashed when the file is read and the
text dropped: only hashes are kept, and no key is ever logged or put in an error message. API_KEY, if
set, still works beside the file (its requests name their tenant with `user`, which may not name a
tenant of the file); ADMIN_API_KEY is the operator's key.

Who may do what (the caller, set before each request): a key's tenant owns its Batch API files and
batches and sees its own figures; the operator (an admin tenant, or ADMIN_API_KEY) sees and changes
everything. A server with neither a keys file nor ADMIN_API_KEY has one party, whoever holds API_KEY
(or anyone, without it): it is the operator, as before roles existed.
"""

import hashlib
import hmac
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from flask import g, request

from api.errors import ApiError, bad
from api.protocol import PRIORITY_LIMIT
from batching.telemetry.tenant_stats import TenantView
from config import Settings
from generate.fair_share import SHARED

# The Batch API's own requests (batching/batch_jobs.py, through the app's test client) carry their batch's
# tenant in this WSGI environ key, which no HTTP header can set (headers become HTTP_* keys).
BATCH_TENANT = "gpt2.batch_tenant"
MAX_USER = 256  # characters of a `user` field that name a tenant


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_waiting: int | None = None
    max_running: int | None = None
    admin: bool = False  # the operator's
    min_priority: int = 0  # the most urgent priority its requests may ask for


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent the request: the owner of what it stores, its tenant (if its key names one), its role."""

    owner: str  # "tenant:<name>", "operator" (ADMIN_API_KEY) or "shared" (API_KEY, or no key)
    tenant: str | None = None
    operator: bool = False
    min_priority: int = 0


NOBODY = Caller("shared")  # an open path's caller: no tenant, no role


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    def __init__(self, tenants: dict[str, Tenant], key_hashes: dict[str, str]):
        self.tenants, self._by_hash = tenants, key_hashes  # name -> tenant; sha256 hex -> name

    @classmethod
    def load(cls, path: str) -> "KeyRing":
        text = Path(path).read_text()
        try:
            data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as err:
            kind = "JSON" if path.endswith(".json") else "TOML"
            raise ValueError(f"API_KEYS_FILE {path}: not valid {kind}: {err}") from None  # says where, not what
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, dict) or not entries:
            raise ValueError(f"API_KEYS_FILE {path}: expected a 'tenants' table of at least one tenant")
        tenants, hashes = {}, {}
        for name, entry in entries.items():
            tenants[name] = _tenant(path, name, entry)
            for key in entry["keys"]:
                digest = key.removeprefix("sha256:").lower() if key.startswith("sha256:") else _hash(key)
                if digest in hashes:
                    raise ValueError(f"API_KEYS_FILE {path}: tenants {hashes[digest]!r} and {name!r} share a key")
                hashes[digest] = name
        return cls(tenants, hashes)

    def tenant(self, key: str) -> Tenant | None:
        name = self._by_hash.get(_hash(key))
        return None if name is None else self.tenants[name]


def _tenant(path: str, name: str, entry: object) -> Tenant:
    """One tenant's entry, checked (the message names the tenant and field, never a key)."""
    where = f"API_KEYS_FILE {path}: tenant {name!r}"
    if not name or not isinstance(entry, dict):
        raise ValueError(f"{where}: each tenant must be a non-empty name with a table of fields")
    unknown = set(entry) - {"keys", "weight", "max_waiting", "max_running", "admin", "min_priority"}
    if unknown:
        raise ValueError(f"{where}: unknown field {min(unknown)!r}")
    keys = entry.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{where}: 'keys' must be a non-empty list of non-empty strings")
    for key in keys:
        digest = key.removeprefix("sha256:")
        if key.startswith("sha256:") and (len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest)):
            raise ValueError(f"{where}: a 'sha256:' key must be 64 hex digits")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1000:
        raise ValueError(f"{where}: 'weight' must be a number above 0 and at most 1000")
    limits = [entry.get(field) for field in ("max_waiting", "max_running")]
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in limits):
        raise ValueError(f"{where}: 'max_waiting' and 'max_running' must be integers of at least 1")
    admin, floor = entry.get("admin", False), entry.get("min_priority", 0)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: 'admin' must be true or false")
    if isinstance(floor, bool) or not isinstance(floor, int) or not -PRIORITY_LIMIT <= floor <= PRIORITY_LIMIT:
        raise ValueError(f"{where}: 'min_priority' must be an integer from {-PRIORITY_LIMIT} to {PRIORITY_LIMIT}")
    return Tenant(name, float(weight), *limits, admin, floor)


def load_keys(settings: Settings) -> KeyRing | None:
    return KeyRing.load(settings.api_keys_file) if settings.api_keys_file else None


def authenticate(settings: Settings, keys: KeyRing | None, open_paths: tuple[str, ...]) -> None:
    """Before each request: who the caller is (g.caller). A key from the file names its tenant; API_KEY
    and ADMIN_API_KEY let a request in without one; with any configured, anything else is a 401 (but
    for the open paths)."""
    g.keys = keys
    if BATCH_TENANT in request.environ:  # one of the server's own Batch API requests: its batch's tenant
        tenant = request.environ[BATCH_TENANT] or None
        g.caller = Caller(f"tenant:{tenant}" if tenant else "shared", tenant, False, -PRIORITY_LIMIT)
        return
    single_party = keys is None and not settings.admin_api_key  # no roles: whoever gets in runs the server
    if not settings.keyed:
        g.caller = Caller("shared", None, True, -PRIORITY_LIMIT)
        return
    if request.path in open_paths:
        g.caller = NOBODY
        return
    given = request.headers.get("Authorization", "").removeprefix("Bearer ")
    tenant = keys.tenant(given) if keys is not None else None
    if tenant is not None:
        g.caller = Caller(f"tenant:{tenant.name}", tenant.name, tenant.admin, tenant.min_priority)
    elif _same(given, settings.admin_api_key):
        g.caller = Caller("operator", None, True, -PRIORITY_LIMIT)
    elif _same(given, settings.api_key):
        g.caller = Caller("shared", None, single_party, -PRIORITY_LIMIT if single_party else 0)
    else:
        message = "a valid 'Authorization: Bearer <API key>' header is required"
        raise ApiError(401, message, "authentication_error", headers={"WWW-Authenticate": "Bearer"})


def _same(given: str, key: str) -> bool:
    """`given` is `key` (compared in constant time); an unset key matches nothing."""
    return bool(key) and hmac.compare_digest(given.encode(), key.encode())


def caller() -> Caller:
    return g.get("caller", NOBODY)


def key_tenant() -> str | None:
    """The tenant of the request's API key (or of its batch), if it has one."""
    return caller().tenant


def view() -> TenantView:
    """Whose figures and request events the caller sees in /stats, /metrics and /stats/timeline: every tenant's
    (the operator), its key's tenant's own, or (any other key) no tenant's."""
    return TenantView(caller().operator, key_tenant())


def require_operator(what: str) -> None:
    """A 403 unless the caller is the operator (an admin tenant, ADMIN_API_KEY, or a server without roles)."""
    if not caller().operator:
        raise ApiError(403, f"only the operator may {what}", "permission_error")


def tenant_of(user: str | None, priority: int = 0) -> str:
    """The request's tenant: its key's, else its `user` field's, else the shared one. A `user` may not
    name a tenant of the keys file: that tenant's limits and share are spent only with its key. Its
    `priority` is checked here too, against what the key allows."""
    _check_priority(priority)
    if user is not None and len(user) > MAX_USER:
        raise ApiError(400, f"'user' must be at most {MAX_USER} characters", param="user")
    if key_tenant():
        return key_tenant()
    keys: KeyRing | None = g.get("keys")
    if user and keys is not None and user in keys.tenants:
        raise bad(f"'user' {user!r} names a tenant of the keys file: its requests need one of its keys", "user")
    return user or SHARED


def _check_priority(priority: int) -> None:
    """A 400 for a `priority` more urgent than the caller may ask for (its tenant's min_priority)."""
    floor = caller().min_priority
    if priority < floor:
        message = f"'priority' must be at least {floor} for this API key (its tenant's min_priority), got {priority}"
        raise bad(message, "priority")
