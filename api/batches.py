"""OpenAI's Batch API, as the official client calls it: upload a JSONL of requests (POST /v1/files,
purpose "batch"), start a batch on it (POST /v1/batches), poll it (GET /v1/batches/{id}), cancel it
(POST /v1/batches/{id}/cancel), download its output and error files (GET /v1/files/{id}/content).
Batches run inside the server (batching/batch_jobs.py); limits: BATCH_MAX_FILE_BYTES per file,
BATCH_MAX_REQUESTS lines per file.
"""

from flask import Blueprint, Response, current_app, jsonify, request

from api.errors import ApiError, bad
from api.protocol import BatchBody, parse
from api.tenants import key_tenant
from batching.batch_jobs import BatchJobs
from batching.batch_store import BatchStore
from config import BatchApiSettings

routes = Blueprint("batches", __name__)


def non_json_post(path: str) -> bool:
    """POSTs whose body is not JSON: an upload (multipart), and a cancel (no body)."""
    return path == "/v1/files" or (path.startswith("/v1/batches/") and path.endswith("/cancel"))


def _jobs() -> BatchJobs:
    return current_app.extensions["batch_jobs"]


def _store() -> BatchStore:
    return _jobs().store


def _settings() -> BatchApiSettings:
    return current_app.extensions["server"].settings.batch_api


@routes.post("/v1/files")
def upload():
    limit = _settings().batch_max_file_bytes
    request.max_content_length = limit + 64 * 1024  # the file and the multipart framing around it
    if request.form.get("purpose") != "batch":
        raise bad("'purpose' must be 'batch' (the only purpose this server takes)", "purpose")
    upload = request.files.get("file")
    if upload is None:
        raise bad("send the file in the multipart field 'file'", "file")
    data = upload.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"the file is larger than BATCH_MAX_FILE_BYTES ({limit} bytes)", param="file")
    try:
        lines = sum(1 for line in data.decode("utf-8").split("\n") if line.strip())
    except UnicodeDecodeError:
        raise bad("the file must be UTF-8 JSONL", "file") from None
    if not 0 < lines <= _settings().batch_max_requests:
        raise bad(f"the file must hold 1 to {_settings().batch_max_requests} requests, one a line", "file")
    return jsonify(_store().add_file(data, upload.filename or "batch.jsonl", "batch"))


def _found(what: str, name: str, found: dict | None) -> dict:
    if found is None:
        raise ApiError(404, f"no {what} {name!r}", "not_found_error", param=f"{what}_id")
    return found


@routes.get("/v1/files/<file_id>")
def file_info(file_id: str):
    return jsonify(_found("file", file_id, _store().file(file_id)))


@routes.get("/v1/files/<file_id>/content")
def file_content(file_id: str):
    _found("file", file_id, _store().file(file_id))
    return Response(_store().content(file_id), mimetype="application/jsonl")


@routes.post("/v1/batches")
def create_batch():
    body = parse(BatchBody, request.get_json(silent=True), "/v1/batches")
    meta = _store().file(body.input_file_id)
    if meta is None or meta["purpose"] != "batch":
        message = f"'input_file_id' must name an uploaded file of purpose 'batch', got {body.input_file_id!r}"
        raise bad(message, "input_file_id")
    return jsonify(_jobs().create(body.input_file_id, body.endpoint, body.metadata, key_tenant() or ""))


@routes.get("/v1/batches")
def list_batches():
    data = sorted(_jobs().list(), key=lambda b: b["created_at"], reverse=True)
    return jsonify(object="list", data=data, has_more=False, first_id=None, last_id=None)


@routes.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str):
    return jsonify(_found("batch", batch_id, _jobs().get(batch_id)))


@routes.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return jsonify(_found("batch", batch_id, _jobs().cancel(batch_id)))
