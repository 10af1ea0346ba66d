"""GET /dashboard (the live page, from dashboard/) and GET /stats/timeline (the JSON it draws).

The page and its script and style hold no data, so they are open even with API_KEY set (a
browser cannot add a header to a navigation): the page asks for the key and sends it with
every /stats/timeline request, which the key guards like every other endpoint.
"""

from pathlib import Path

from flask import Blueprint, Response, abort, jsonify, request

from api import tenants
from api.errors import bad
from api.generation import server
from api.stats import report

PAGE_DIR = Path(__file__).resolve().parent.parent / "dashboard"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PAGE_PATHS = ("/dashboard", *(f"/dashboard/{name}" for name in ASSETS))
# Everything from this server, nothing inline or from elsewhere: the page works offline and
# a script injected into it would not run.
CSP = "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

routes = Blueprint("dashboard", __name__)


@routes.get("/dashboard")
def page():
    # The page learns whether to ask for a key before its first request, so it never draws a 401.
    html = (PAGE_DIR / "index.html").read_text()
    html = html.replace("{{key_required}}", "true" if server().settings.keyed else "false")
    return _static(html, "text/html")


@routes.get("/dashboard/<name>")
def asset(name: str):
    if name not in ASSETS:
        abort(404)
    return _static((PAGE_DIR / name).read_text(), ASSETS[name])


@routes.get("/stats/timeline")
def stats_timeline():
    view = tenants.view()
    return jsonify(report("timeline", _cursor("since"), _cursor("events_since"), view.every, view.tenant))


def _cursor(name: str) -> int:
    raw = request.args.get(name, "0")
    if not raw.isdigit():
        raise bad(f"'{name}' must be a non-negative integer, got {raw!r}", name)
    return int(raw)


def _static(body: str, mimetype: str) -> Response:
    response = Response(body, mimetype=mimetype)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["Cache-Control"] = "no-cache"
    return response
