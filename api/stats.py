"""GET /stats (JSON) and GET /metrics (Prometheus): two renderings of the live table. The per-tenant figures
and the adapters of running and waiting requests are the operator's to see; a tenant's key sees its own
figures (api/tenants.py), the rest of the server's as anyone does. Both are computed where the engine runs
(batching/telemetry/reports.py)."""

from flask import Blueprint, Response, jsonify

from api import tenants
from api.errors import ApiError
from api.generation import server
from batching.manager import NotServing

routes = Blueprint("stats", __name__)


@routes.get("/stats")
def stats():
    view = tenants.view()
    return jsonify(report("stats", view.every, view.tenant))


@routes.get("/metrics")
def prometheus():
    view = tenants.view()
    body, content_type = report("metrics", view.every, view.tenant)
    return Response(body, content_type=content_type)


def report(name: str, *args):
    """A report from wherever the engine runs; an engine process that cannot answer is a 503."""
    try:
        return server().manager.report(name, *args)
    except NotServing as err:
        raise ApiError(503, str(err), "unavailable") from None
