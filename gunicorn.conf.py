"""gunicorn settings for server.sh: one worker holds the model (or API_SERVER_COUNT workers share the engine's
process); a worker's threads hold requests."""

import os
import shutil
import signal
import sys
import tempfile

from batching import engine_process
from config import Settings
from model.loader import ModelLoadError, resolve_model
from sim.engine import simulated_engine

try:
    settings = Settings.from_env()
except ValueError as err:  # a bad setting is one clear line, not a traceback
    sys.exit(f"error: {err}")

bind = f"{settings.host}:{settings.port}"
# one model, one KV cache, one batching loop; API_SERVER_COUNT front ends (each a worker) share the one engine
workers = settings.api_server_count
worker_class = "gthread"
# Every request in flight holds a thread while it waits on its event: too few threads
# would silently cap the batch, so there is one for each request the server admits (running
# and waiting). The spare ones can never all be held by generations: with every admitted
# request in flight, /health (a load balancer's check), /stats and the quick 503 of a request
# beyond MAX_WAITING still find a thread instead of queueing behind generations for minutes.
# (The front door sends a replica no more requests at once than it has threads: deploy/env.py.)
threads = settings.server_threads
worker_connections = threads + 64
timeout = 600  # the worker loads the model before it answers gunicorn's heartbeat
graceful_timeout = int(settings.shutdown_grace_s) + 10  # the app answers stragglers first
accesslog = None


def on_starting(server) -> None:
    """Resolve (and download) the model before forking, so a bad MODEL is one clear line, as is a
    MAX_BATCH_TOKENS that cannot hold its context with CHUNKED_PREFILL off.

    ENGINE=sim: build the simulated engine once here instead (cheap: no tensors), so an
    unknown SIM_MODEL or SIM_GPU, or a model too big for the simulated GPUs, is one line too.
    """
    try:
        if settings.engine.engine == "sim":
            simulated_engine(settings.engine, announce=False)
        else:
            settings.engine.batch_token_budget(False, resolve_model(settings.engine.model).config().n_positions)
    except (ModelLoadError, ValueError) as err:  # ValueError: a ProfileError, or MAX_BATCH_TOKENS too small
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


def post_worker_init(worker) -> None:
    """On SIGTERM, running requests get SHUTDOWN_GRACE_S to finish; the rest are answered with an error."""
    manager = worker.wsgi.extensions["server"].manager
    stop_worker = worker.handle_exit

    def handle_exit(sig, frame) -> None:
        manager.shut_down(settings.shutdown_grace_s)
        stop_worker(sig, frame)

    signal.signal(signal.SIGTERM, handle_exit)


keeper: engine_process.EngineKeeper | None = None  # the master's (API_SERVER_COUNT > 1)


def when_ready(server) -> None:
    """API_SERVER_COUNT > 1: the master starts the one engine (batching/engine_process.py's keeper, which starts
    another whenever it dies) before it forks the workers, each of them a front end of that engine. A bad
    model is one line here."""
    if settings.api_server_count == 1 or settings.engine_process != "on":
        return  # the one worker starts its own engine (ENGINE_PROCESS=on) or holds it (off)
    from app import engine_recipe

    global keeper
    directory = tempfile.mkdtemp(prefix="engine-")  # the sockets' directory: this user's alone (0700)
    keeper = engine_process.EngineKeeper(settings, *engine_recipe(settings), directory)
    try:
        keeper.start()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    os.environ[engine_process.DIRECTORY_VARIABLE] = directory  # the workers, forked after this, read it


def on_exit(server) -> None:
    """The master's end, its workers gone: its engine (API_SERVER_COUNT > 1) ends too."""
    if keeper is not None:
        keeper.stop()
        shutil.rmtree(os.environ[engine_process.DIRECTORY_VARIABLE], ignore_errors=True)
