"""GET /stats (JSON) and GET /metrics (Prometheus): two renderings of the live table."""

from flask import Blueprint, Response, jsonify

from api.sampling import server
from batching import metrics
from batching.server_stats import server_stats

routes = Blueprint("stats", __name__)


@routes.get("/stats")
def stats():
    return jsonify(server_stats(server().manager))


@routes.get("/metrics")
def prometheus():
    manager = server().manager
    running, waiting = manager.lora_names()
    loras = metrics.lora_requests_info(manager.engine.model_name, running, waiting, manager.settings.engine.max_loras)
    body, content_type = metrics.render(manager.live, manager.step_summary(), loras)
    return Response(body, content_type=content_type)
