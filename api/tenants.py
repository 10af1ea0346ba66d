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

A key written "sha256:<hex>" is stored as that hash; any other is hashed when the file is read and the
text dropped: only hashes are kept, and no key is ever logged or put in an error message. API_KEY, if
set, still works beside the file (its requests name their tenant with `user`).
"""

import hashlib
import hmac
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from flask import g, request

from api.errors import ApiError
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
    unknown = set(entry) - {"keys", "weight", "max_waiting", "max_running"}
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
    return Tenant(name, float(weight), *limits)


def load_keys(settings: Settings) -> KeyRing | None:
    return KeyRing.load(settings.api_keys_file) if settings.api_keys_file else None


def authenticate(settings: Settings, keys: KeyRing | None, open_paths: tuple[str, ...]) -> None:
    """Before each request: a key from the file names the request's tenant; API_KEY lets it in without
    one; with either configured, anything else is a 401 (but for the open paths)."""
    if BATCH_TENANT in request.environ:  # one of the server's own Batch API requests
        g.key_tenant = request.environ[BATCH_TENANT]
        return
    if (not settings.api_key and keys is None) or request.path in open_paths:
        return
    given = request.headers.get("Authorization", "").removeprefix("Bearer ")
    tenant = keys.tenant(given) if keys is not None else None
    if tenant is not None:
        g.key_tenant = tenant.name
    elif not (settings.api_key and hmac.compare_digest(given.encode(), settings.api_key.encode())):
        message = "a valid 'Authorization: Bearer <API key>' header is required"
        raise ApiError(401, message, "authentication_error", headers={"WWW-Authenticate": "Bearer"})


def key_tenant() -> str | None:
    """The tenant of the request's API key (or of its batch), if it has one."""
    return g.get("key_tenant")


def tenant_of(user: str | None) -> str:
    """The request's tenant: its key's, else its `user` field's, else the shared one."""
    if user is not None and len(user) > MAX_USER:
        raise ApiError(400, f"'user' must be at most {MAX_USER} characters", param="user")
    return key_tenant() or user or SHARED
