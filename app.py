"""HTTP front of the batching server: a Flask app factory over one BatchingManager per process."""

import functools
import logging
import os
import sys
from collections.abc import Callable

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from api import batch_owner, batches, chat, dashboard, lora, openai, simple, stats, tenants, tokenize
from api.chat_template import ChatTemplate
from api.errors import ApiError
from api.generation import Server
from api.json_body import StrictJSONProvider, require_json
from api.protocol import PRIORITY_LIMIT
from batching import engine_process
from batching.batch_jobs import BatchJobs
from batching.batch_store import BatchStore
from batching.engine_client import EngineClient
from batching.manager import BatchingManager
from config import Settings
from generate.engine import Engine
from model.tokenizer import load_tokenizer
from sim.engine import simulated_engine

log = logging.getLogger(__name__)

# Reachable without the API key: /health for load balancers; the dashboard page, which holds no
# data (its data, /stats/timeline, needs the key).
OPEN_PATHS = ("/health", *dashboard.PAGE_PATHS)


def create_app(settings: Settings | None = None) -> Flask:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings or Settings.from_env()
    log.info("settings: %s", settings.redacted())
    for warning in settings.exposure_warnings(front=False):  # exposed with a front, this server is on loopback
        log.warning("%s", warning)
    template = ChatTemplate.load(settings.chat_template)  # a bad file stops the server before the model loads
    keys = tenants.load_keys(settings)  # so does a bad keys file
    if settings.switch_interval_ms:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    build, table = engine_recipe(settings, keys)
    if settings.engine_process == "on":  # the engine in a process of its own; this one serves HTTP
        # several front ends (API_SERVER_COUNT): gunicorn's master started the engine (gunicorn.conf.py)
        manager = EngineClient(settings, build, table, os.environ.get(engine_process.DIRECTORY_VARIABLE, ""))
    else:
        manager = BatchingManager(build, settings)  # built on the loop's thread
        manager.engine.scheduler.fair.weights.update({name: weight for name, (weight, _, _) in table.items()})
        manager.admission.tenants.limits.update(
            {name: (waiting, running) for name, (_, waiting, running) in table.items()}
        )
    engine = manager.engine
    manager.start()

    app = Flask(__name__)
    app.json = StrictJSONProvider(app)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["server"] = Server(settings, engine, manager, load_tokenizer(), template)
    for blueprint in (
        simple.routes,
        openai.routes,
        chat.routes,
        tokenize.routes,
        dashboard.routes,
        stats.routes,
        batches.routes,
        lora.routes,
    ):
        app.register_blueprint(blueprint)

    @app.errorhandler(ApiError)
    def api_error(err: ApiError):
        return jsonify(err.body()), err.status, err.headers

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        return api_error(ApiError(err.code or 500, err.description or err.name, type(err).__name__))

    @app.before_request
    def require_api_key():
        tenants.authenticate(settings, keys, OPEN_PATHS)

    @app.before_request
    def require_json_posts():
        if request.method == "POST" and request.routing_exception is None and not batches.non_json_post(request.path):
            require_json(request.is_json, request.content_type)

    @app.after_request
    def name_replica(response: Response) -> Response:
        """Behind a load balancer, every response says which replica answered it."""
        response.headers["X-Replica"] = settings.replica
        return response

    @app.get("/health")
    def health():
        """Alive: the model is loaded and the loop runs and makes progress, however busy it is."""
        body = {"model": engine.model_name, "random_weights": engine.is_random, "mode": settings.mode}
        if settings.exposed:  # server.sh found no HAProxy to put in front, or FRONT=off
            body["warning"] = settings.no_front_warning
        if settings.engine_process == "on":
            body["engine_restarts"] = manager.restarts  # the engine's process, started again after it died
        problem = manager.health_problem()
        if problem:
            return jsonify(status="unavailable", reason=problem, **body), 503
        return jsonify(status="ok", **body)

    @app.get("/ready")
    def ready():
        """Ready for one more request: alive, and the queue has room."""
        if not manager.ready or manager.num_waiting() >= settings.max_waiting:
            return jsonify(status="busy" if manager.ready else "unavailable"), 503
        return jsonify(status="ready")

    # Last: a batch resumed from DATA_DIR sends its first request at once, and the app must be complete by then.
    _batch_jobs(app, settings, manager)
    return app


def engine_recipe(settings: Settings, keys=None) -> tuple[Callable[[], Engine], dict[str, tuple[float, int, int]]]:
    """What builds the engine (called on its loop's thread, in whichever process runs it), and each keyed
    tenant's fair-share weight and limits (max waiting, max running)."""
    keys = keys if keys is not None else tenants.load_keys(settings)
    build = simulated_engine if settings.engine.engine == "sim" else Engine.from_settings
    table = {t.name: (t.weight, t.max_waiting, t.max_running) for t in keys.tenants.values()} if keys else {}
    return functools.partial(build, settings.engine), table


def _batch_jobs(app: Flask, settings: Settings, manager: BatchingManager | EngineClient) -> None:
    """The Batch API's runner, app.extensions["batch_jobs"]: each request goes through the app's own endpoint, at
    the lowest priority, for the tenant that created its batch. With API_SERVER_COUNT > 1 one worker at a time
    runs it, and the others forward the Batch API's requests to that one (api/batch_owner.py)."""
    client = app.test_client(use_cookies=False)

    def send(endpoint: str, body: dict, tenant: str) -> tuple[int, dict]:
        response = client.post(endpoint, json=body, environ_base={tenants.BATCH_TENANT: tenant})
        return response.status_code, response.get_json(silent=True)

    def start() -> BatchJobs:
        jobs = BatchJobs(
            BatchStore(settings.batch_api.data_dir),
            send,
            lambda: manager.alive,
            PRIORITY_LIMIT,
            settings.batch_api.batch_in_flight,
        )
        jobs.start()
        return jobs

    if settings.api_server_count > 1:
        batch_owner.share(app, settings.batch_api, start)
    else:
        app.extensions["batch_jobs"] = start()
