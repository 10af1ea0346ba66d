"""GET /stats (JSON) and GET /metrics (Prometheus): two renderings of the live table. The per-tenant figures
and the adapters of running and waiting requests are the operator's to see; a tenant's key sees its own
figures (api/tenants.py), the rest of the server's as anyone does."""

from flask import Blueprint, Response, jsonify

from api import tenants
from api.sampling import server
from batching import metrics
from batching.server_stats import server_stats
from batching.tenant_stats import only_shown

routes = Blueprint("stats", __name__)


@routes.get("/stats")
def stats():
    manager = server().manager
    return jsonify(only_shown(server_stats(manager), tenants.view(), manager.engine.scheduler.fair.ledger))


@routes.get("/metrics")
def prometheus():
    manager, view = server().manager, tenants.view()
    loras = None
    if view.every:
        running, waiting = manager.lora_names()
        engine_settings = manager.settings.engine
        loras = metrics.lora_requests_info(manager.engine.model_name, running, waiting, engine_settings.max_loras)
    body, content_type = metrics.render(manager.live, manager.step_summary(), loras, view)
    return Response(body, content_type=content_type)
