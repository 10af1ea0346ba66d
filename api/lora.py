"""LoRA adapters while serving, as vLLM's endpoints: POST /v1/load_lora_adapter, /v1/unload_lora_adapter.

As in vLLM, the two endpoints exist only with ALLOW_RUNTIME_LORA_UPDATING (else any request for them
is a 404); then only the operator may call them (403 for anyone else), and an adapter is read only
from a directory under LORA_ROOT, every path resolved (symlinks included). A path refused for where it
is, or for what is missing there, gets the same words, so the answer tells nothing of what exists.

An adapter is served as a model of its own name (/v1/models lists it, with the base model as its
parent); a request picks it with "model". Unloading waits for nothing: while accepted requests still
use the adapter it is refused (409), and the caller retries (docs/lora.md).
"""

import logging

from flask import Blueprint, request
from flask.blueprints import BlueprintSetupState

from api.errors import ApiError, bad
from api.generation import server
from api.protocol import LoadLoraBody, UnloadLoraBody, parse
from api.tenants import require_operator
from generate.lora_registry import LoraInUse, LoraNotFound
from model.lora import LoraError

routes = Blueprint("lora", __name__)
log = logging.getLogger(__name__)


@routes.record_once
def _register(state: BlueprintSetupState) -> None:
    """The endpoints, only where runtime updating is allowed (as vLLM registers them)."""
    settings = state.app.extensions["server"].settings
    if not settings.allow_runtime_lora_updating:
        return
    log.warning(
        "ALLOW_RUNTIME_LORA_UPDATING is on: the operator may load adapters from under LORA_ROOT (%s) while serving",
        settings.lora_root,
    )
    for view in (load_lora_adapter, unload_lora_adapter):
        state.app.add_url_rule(f"/v1/{view.__name__}", view_func=view, methods=["POST"])


def load_lora_adapter():
    require_operator("load LoRA adapters")
    body = parse(LoadLoraBody, request.get_json(silent=True), "/v1/load_lora_adapter")
    engine, name, path = server().engine, body.lora_name, body.lora_path
    if name == engine.model_name:
        raise bad(f"'{name}' is the base model's name", "lora_name")
    try:
        adapter = engine.loras.load(name, path, root=server().settings.lora_root)
    except LoraError as err:  # the adapter itself
        raise bad(str(err), "lora_path") from None
    except ValueError as err:  # the name taken, or MAX_CPU_LORAS reached
        raise bad(str(err), "lora_name") from None
    log.info("LoRA adapter %r loaded from %s (rank %d, id %d)", name, path, adapter.rank, adapter.id)
    return f"Success: LoRA adapter '{name}' added successfully.", 200, {"Content-Type": "text/plain"}


def unload_lora_adapter():
    require_operator("unload LoRA adapters")
    body = parse(UnloadLoraBody, request.get_json(silent=True), "/v1/unload_lora_adapter")
    name = body.lora_name
    try:
        server().engine.loras.unload(name)
    except LoraNotFound as err:
        raise ApiError(404, str(err), "NotFoundError", param="lora_name") from None
    except LoraInUse as err:
        raise ApiError(409, str(err), "conflict", param="lora_name") from None
    log.info("LoRA adapter %r unloaded", name)
    return f"Success: LoRA adapter '{name}' removed successfully.", 200, {"Content-Type": "text/plain"}


def model_cards() -> list[dict]:
    """/v1/models: the base model, then each adapter with the base as its parent and its path as root."""
    engine = server().engine
    base = engine.model_name
    card = {"object": "model", "created": 0, "owned_by": "local", "max_model_len": engine.max_context}
    cards = [{**card, "id": base, "root": base, "parent": None}]
    return cards + [{**card, "id": a.name, "root": a.path, "parent": base} for a in engine.loras.adapters()]
