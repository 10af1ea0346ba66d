"""API_SERVER_COUNT > 1: one Batch API behind every front end (gunicorn worker).

A batch must run once, and its runner (batching/batch_jobs.py) holds the batches in memory with the lines
it has sent; so exactly one worker at a time, the owner, builds the runner and serves /v1/files and
/v1/batches. Every worker has a thread waiting in flock() on DATA_DIR/.batch-owner.lock; the one that gets
it owns the Batch API for as long as it lives. When it dies (an exit, a crash, kill -9) the kernel frees
the lock and a waiting worker takes over, resuming the unfinished batches from DATA_DIR exactly as a
restarted server does: each line without a result runs again, each with one runs no more.

The owner also serves the Batch API's routes, and nothing else, on a unix socket in a private directory,
published in DATA_DIR/.batch-owner.json; the other workers forward those routes' requests there as they
came (method, path, query, headers, the body streamed) and answer with the owner's status, headers and
body. The owner checks the API key of a forwarded request as of any: nothing is trusted for arriving on
the socket.
"""

import atexit
import contextlib
import fcntl
import http.client
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException
from werkzeug.serving import WSGIRequestHandler, make_server

from api import batches
from api.errors import ApiError
from batching.batch_jobs import BatchJobs
from config import BatchApiSettings

log = logging.getLogger(__name__)

LOCK_FILE = ".batch-owner.lock"
ADDRESS_FILE = ".batch-owner.json"  # {"pid": the owner's, "socket": where it listens}
SOCKET_NAME = "batch-api.sock"
OWNER_WAIT_S = 10.0  # a forwarded request waits this long for an owner (one starting, or taking over)
RETRY_S = 0.05
ANSWER_TIMEOUT_S = 60.0  # the Batch API's routes read and write DATA_DIR only: an owner this slow is stuck
CHUNK = 64 * 1024
# A connection's own headers (RFC 9110 7.6.1), and those each server sets for itself: not passed on.
NOT_PASSED = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
    | {"host", "server", "date"}
)


def share(app: Flask, settings: BatchApiSettings, start: Callable[[], BatchJobs]) -> None:
    """Make this worker one of the Batch API's front ends: it forwards the Batch API's requests to the owner
    until it is the owner itself, and then runs `start()` as app.extensions["batch_jobs"]."""
    data_dir = Path(settings.data_dir)
    app.before_request(lambda: _forward_unless_owner(app, data_dir, batches.upload_limit(settings)))
    threading.Thread(target=_own, args=(app, data_dir, start), name="batch-owner", daemon=True).start()


# --- the owner ------------------------------------------------------------------------------------
def _own(app: Flask, data_dir: Path, start: Callable[[], BatchJobs]) -> None:
    """Wait to be the owner; then run the Batch API here and serve it to the other workers, for this worker's life."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # never closed: held until this ends
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks, without the GIL, while another worker lives as the owner
        _remove_socket(_address(data_dir))  # the previous owner's, dead now
        app.extensions["batch_jobs"] = start()  # resumes the unfinished batches, as after a restart
        path = os.path.join(tempfile.mkdtemp(prefix="batch-api-"), SOCKET_NAME)  # mode 0700; short (108 bytes)
        server = make_server(f"unix://{path}", 0, _batch_routes_only(app), threaded=True, request_handler=_Quiet)
        threading.Thread(target=server.serve_forever, name="batch-api-socket", daemon=True).start()
        _publish(data_dir, address := {"pid": os.getpid(), "socket": path})
        atexit.register(_remove_socket, address)  # on an exit; after a kill, the next owner removes it
        log.info("worker %d owns the Batch API (its socket: %s)", os.getpid(), path)
    # SystemExit: werkzeug's make_server exits when it cannot listen. A lock held stays held: a worker taking
    # over would most likely fail the same way.
    except (Exception, SystemExit):
        log.exception("worker %d cannot run the Batch API: its requests are 503s until a restart", os.getpid())


def _batch_routes_only(app: Flask) -> Callable:
    """The socket's WSGI app: the Batch API's routes, and a 404 for anything else (it is no second way in)."""
    prefix = f"{batches.routes.name}."

    def serve(environ: dict, start_response: Callable) -> Iterator[bytes]:
        try:
            endpoint = app.url_map.bind_to_environ(environ).match()[0]
        except HTTPException:
            endpoint = ""
        if endpoint.startswith(prefix):
            return app(environ, start_response)
        body = ApiError(404, "this socket serves the Batch API alone", "not_found_error").body()
        return Response(json.dumps(body), 404, mimetype="application/json")(environ, start_response)

    return serve


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args) -> None:
        """No access log: the server has none (gunicorn's accesslog is off), and clients poll batches often."""


def _publish(data_dir: Path, address: dict) -> None:
    """Written whole, then renamed: a forwarding worker never reads half an address."""
    tmp = data_dir / f"{ADDRESS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(address))
    os.replace(tmp, data_dir / ADDRESS_FILE)


def _address(data_dir: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((data_dir / ADDRESS_FILE).read_text())
    return None


def _remove_socket(address: dict | None) -> None:
    """A dead owner's socket and its directory (only if it is one of ours, and otherwise empty)."""
    path = Path(address["socket"]) if address else None
    if path is not None and path.name == SOCKET_NAME:
        with contextlib.suppress(OSError):
            path.unlink()
            path.parent.rmdir()


# --- the other workers ----------------------------------------------------------------------------
def _forward_unless_owner(app: Flask, data_dir: Path, upload_limit: int) -> Response | None:
    """Before each request (after its API key is checked): a Batch API request, in a worker that is not its
    owner, is the owner's answer to it; anything else is served here."""
    if request.blueprint != batches.routes.name or "batch_jobs" in app.extensions:
        return None
    if request.endpoint == "batches.upload":  # the owner allows it as much (the app's limit is for the rest)
        request.max_content_length = upload_limit
    has_body = bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    body = request.stream if has_body else None  # a body over the limit is a 413 here, before the owner is asked
    # Sent again after a failure only if nothing was sent that could have taken effect, and can be sent again.
    resendable = body is None and request.method in ("GET", "HEAD")
    deadline = time.monotonic() + OWNER_WAIT_S
    while True:
        connection = _connect(data_dir, deadline)
        try:
            answer = _ask(connection, body)
        except OSError as err:  # the owner died with the request: a successor may be taking over
            if resendable and time.monotonic() < deadline:
                continue
            message = f"the Batch API's owner (another worker) stopped before it answered: {err}"
            raise ApiError(502, message, "unavailable", headers={"Retry-After": "1"}) from None
        headers = [(name, value) for name, value in answer.getheaders() if name.lower() not in NOT_PASSED]
        return Response(_relay(answer, connection), answer.status, headers)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str):
        super().__init__("localhost", timeout=ANSWER_TIMEOUT_S, blocksize=CHUNK)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _connect(data_dir: Path, deadline: float) -> _UnixConnection:
    """A connection to the owner, waiting until `deadline` while there is none: a 503 then."""
    while True:
        address = _address(data_dir)
        if address is not None:
            connection = _UnixConnection(address["socket"])
            try:
                connection.connect()
                return connection
            except OSError:  # a dead owner's socket: its successor has not published its own yet
                connection.close()
        if time.monotonic() >= deadline:
            message = f"no worker serves the Batch API yet (one is starting, or taking over): waited {OWNER_WAIT_S} s"
            raise ApiError(503, message, "unavailable", headers={"Retry-After": "1"})
        time.sleep(RETRY_S)  # polling for the owner's address, under the deadline


def _ask(connection: _UnixConnection, body) -> http.client.HTTPResponse:
    """The request, as it came, on to the owner: its answer, whose body is still to read."""
    path = quote(request.path) + (f"?{request.query_string.decode('latin-1')}" if request.query_string else "")
    headers = {name: value for name, value in request.headers.items() if name.lower() not in NOT_PASSED}
    try:
        connection.request(request.method, path, body=body, headers=headers)
        return connection.getresponse()
    except BaseException:  # an OSError, or the client's body cut short or too large (a 413 here)
        connection.close()
        raise


def _relay(answer: http.client.HTTPResponse, connection: _UnixConnection) -> Iterator[bytes]:
    """The owner's body, as it comes (a downloaded file may be large)."""
    try:
        while chunk := answer.read(CHUNK):
            yield chunk
    finally:
        connection.close()
