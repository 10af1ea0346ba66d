"""OpenAI's Batch API, as the official client calls it: upload a JSONL of requests (POST /v1/files,
purpose "batch"), start a batch on it (POST /v1/batches), poll it (GET /v1/batches/{id}), cancel it
(POST /v1/batches/{id}/cancel), download its output and error files (GET /v1/files/{id}/content),
list and delete files (GET /v1/files, DELETE /v1/files/{id}).

Batches run inside the server (batching/batch_jobs.py). Each file and batch is its owner's: another
key's is a 404, as if it did not exist (not a 403, which would say it does), everywhere an id is
taken; the operator sees and acts on every owner's. Limits: BATCH_MAX_FILE_BYTES per file,
BATCH_MAX_REQUESTS lines per file, and per owner BATCH_TENANT_MAX_BYTES stored and
BATCH_TENANT_MAX_BATCHES batches not yet ended (429 past either).
"""

from flask import Blueprint, Response, current_app, jsonify, request

from api import tenants
from api.errors import ApiError, bad
from api.protocol import BatchBody, parse
from batching.batch_jobs import BatchJobs, FileInUse, NoSuchFile, OverQuota
from config import BatchApiSettings

routes = Blueprint("batches", __name__)


def non_json_post(path: str) -> bool:
    """POSTs whose body is not JSON: an upload (multipart), and a cancel (no body)."""
    return path == "/v1/files" or (path.startswith("/v1/batches/") and path.endswith("/cancel"))


def _jobs() -> BatchJobs:
    return current_app.extensions["batch_jobs"]


def _settings() -> BatchApiSettings:
    return current_app.extensions["server"].settings.batch_api


def _scope() -> str | None:
    """Whose files and batches the caller may see and act on: its own, or (None) every owner's, the operator's."""
    caller = tenants.caller()
    return None if caller.operator else caller.owner


def upload_limit(settings: BatchApiSettings) -> int:
    """The largest body an upload may have: the file and the multipart framing around it."""
    return settings.batch_max_file_bytes + 64 * 1024


def _over_quota(err: OverQuota, param: str) -> ApiError:
    return ApiError(429, str(err), "insufficient_quota", param)


@routes.post("/v1/files")
def upload():
    settings = _settings()
    limit = settings.batch_max_file_bytes
    request.max_content_length = upload_limit(settings)
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
    if not 0 < lines <= settings.batch_max_requests:
        raise bad(f"the file must hold 1 to {settings.batch_max_requests} requests, one a line", "file")
    owner, name = tenants.caller().owner, upload.filename or "batch.jsonl"
    try:
        return jsonify(_jobs().add_file(data, name, owner, settings.batch_retention_s, settings.batch_tenant_max_bytes))
    except OverQuota as err:
        raise _over_quota(err, "file") from None


def _found(what: str, name: str, found: dict | None) -> dict:
    if found is None:
        raise _not_found(what, name)
    return found


def _not_found(what: str, name: str) -> ApiError:
    return ApiError(404, f"no {what} {name!r}", "not_found_error", param=f"{what}_id")


@routes.get("/v1/files")
def list_files():
    data = sorted(_jobs().files(_scope()), key=lambda f: f["created_at"], reverse=True)
    return jsonify(object="list", data=data, has_more=False, first_id=None, last_id=None)


@routes.get("/v1/files/<file_id>")
def file_info(file_id: str):
    return jsonify(_found("file", file_id, _jobs().file(file_id, _scope())))


@routes.get("/v1/files/<file_id>/content")
def file_content(file_id: str):
    _found("file", file_id, _jobs().file(file_id, _scope()))
    return Response(_jobs().store.content(file_id), mimetype="application/jsonl")


@routes.delete("/v1/files/<file_id>")
def delete_file(file_id: str):
    try:
        deleted = _jobs().delete_file(file_id, _scope())
    except FileInUse as err:
        raise ApiError(409, str(err), "conflict", "file_id") from None
    if not deleted:
        raise _not_found("file", file_id)
    return jsonify(id=file_id, object="file", deleted=True)


@routes.post("/v1/batches")
def create_batch():
    body = parse(BatchBody, request.get_json(silent=True), "/v1/batches")
    caller, settings = tenants.caller(), _settings()
    try:
        batch = _jobs().create(
            body.input_file_id,
            body.endpoint,
            body.metadata,
            tenant=caller.tenant or "",
            owner=caller.owner,
            scope=_scope(),
            retention_s=settings.batch_retention_s,
            max_retries=settings.batch_max_retries,
            max_open=settings.batch_tenant_max_batches,
        )
    except NoSuchFile:
        raise ApiError(404, f"no file {body.input_file_id!r}", "not_found_error", "input_file_id") from None
    except ValueError as err:
        raise bad(str(err), "input_file_id") from None
    except OverQuota as err:
        raise _over_quota(err, "input_file_id") from None
    return jsonify(batch)


@routes.get("/v1/batches")
def list_batches():
    data = sorted(_jobs().list(_scope()), key=lambda b: b["created_at"], reverse=True)
    return jsonify(object="list", data=data, has_more=False, first_id=None, last_id=None)


@routes.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str):
    return jsonify(_found("batch", batch_id, _jobs().get(batch_id, _scope())))


@routes.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return jsonify(_found("batch", batch_id, _jobs().cancel(batch_id, _scope())))
