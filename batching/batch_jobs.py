"""OpenAI's Batch API, run inside the server: each request of a batch goes through the server's own
endpoint (the same code as over HTTP), at the lowest priority, so a batch fills idle capacity and
yields to interactive requests within a step or two.

Batches run one at a time, oldest first, BATCH_IN_FLIGHT requests at once. Every input line ends
in exactly one result line: the output file (status 200) or the error file (a bad line, with its
custom_id when it has one; an endpoint's 4xx). A refusal for load (429, 503, 504) is tried again.
When the server stops, requests not answered are left without a result, and after the restart
(batch_store.py) they run again: nothing lost, nothing twice. Cancelling stops new requests; those
in flight finish, and the batch is `cancelled` with what it has. Its requests count for the tenant
that created it (fair share: generate/fair_share.py), kept with the batch but not shown.
"""

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from batching.batch_store import BatchStore, new_id, result_id

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
RETRIED = (429, 503, 504)  # refused for load, or timed out in the queue: not the request's fault
RETRY_PAUSE_S = 1.0
RUNNABLE = ("validating", "in_progress", "finalizing", "cancelling")

Send = Callable[[str, dict, str], tuple[int, dict]]  # (endpoint, body, tenant) -> (status, JSON answer)
PRIVATE = ("tenant",)  # kept with a batch, not shown


class BadLine(ValueError):
    def __init__(self, message: str, custom_id: str | None):
        super().__init__(message)
        self.custom_id = custom_id


class BatchJobs:
    def __init__(self, store: BatchStore, send: Send, serving: Callable[[], bool], priority: int, in_flight: int):
        self.store, self.send, self.serving = store, send, serving
        self.priority, self.in_flight = priority, in_flight
        self._cond = threading.Condition()  # guards _batches; the runner waits on it for work
        self._batches = {b["id"]: b for b in store.batches()}  # authoritative; each change is saved
        self._thread = threading.Thread(target=self._run, name="batch-jobs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- request threads ----------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, metadata: dict | None, tenant: str = "") -> dict:
        hex_id = new_id("")
        batch = {
            "id": f"batch_{hex_id}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": int(time.time()),
            "in_progress_at": None,
            "expires_at": int(time.time()) + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(_lines(self.store.content(input_file_id))), "completed": 0, "failed": 0},
            "metadata": metadata,
            "tenant": tenant,  # "": its requests name their own (their `user`), as any request does
        }
        for kind in ("output", "errors"):
            self.store.add_file(b"", f"{batch['id']}_{kind}.jsonl", f"batch_{kind}", f"file-{hex_id}-{kind}")
        with self._cond:
            self._batches[batch["id"]] = batch
            self.store.save(batch)
            self._cond.notify()
        return _public(batch)

    def get(self, batch_id: str) -> dict | None:
        with self._cond:
            batch = self._batches.get(batch_id)
            return None if batch is None else _public(batch)

    def list(self) -> list[dict]:
        with self._cond:
            return [_public(b) for b in self._batches.values()]

    def cancel(self, batch_id: str) -> dict | None:
        with self._cond:
            batch = self._batches.get(batch_id)
            if batch is not None and batch["status"] in ("validating", "in_progress"):
                self._update(batch, status="cancelling", cancelling_at=int(time.time()))
            return self.get(batch_id)

    # --- the runner thread --------------------------------------------------------------------
    def _update(self, batch: dict, **changes) -> None:
        """Change a batch and save it (the caller holds _cond)."""
        batch.update(changes)
        self.store.save(batch)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (runnable := [b for b in self._batches.values() if b["status"] in RUNNABLE]):
                    self._cond.wait()
            try:
                self._run_batch(runnable[0])
            except Exception:  # a batch must not take the runner with it
                log.exception("batch %s failed", runnable[0]["id"])
                with self._cond:
                    self._update(runnable[0], status="failed", failed_at=int(time.time()))
            if not self.serving():
                return  # the server is stopping: what is left runs after the restart

    def _run_batch(self, batch: dict) -> None:
        hex_id = batch["id"].removeprefix("batch_")
        out, err = f"file-{hex_id}-output", f"file-{hex_id}-errors"
        lines = _lines(self.store.content(batch["input_file_id"]))
        done_out, done_err = self.store.done_lines(out), self.store.done_lines(err)
        with self._cond:
            counts = {"total": len(lines), "completed": len(done_out), "failed": len(done_err)}
            if batch["status"] == "validating":
                self._update(batch, status="in_progress", in_progress_at=int(time.time()), request_counts=counts)
        first = _first_lines(lines)
        slots = threading.BoundedSemaphore(self.in_flight)
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="batch-request") as pool:
            for number, raw in lines.items():
                if number in done_out or number in done_err:
                    continue
                slots.acquire()
                if batch["status"] == "cancelling" or not self.serving():
                    slots.release()
                    break
                future = pool.submit(self._one, batch, number, raw, first, (out, err))
                future.add_done_callback(lambda _: slots.release())
        if not self.serving():
            return
        with self._cond:
            ended = "cancelled" if batch["status"] == "cancelling" else "completed"
            now = int(time.time())
            self._update(batch, status="finalizing", finalizing_at=now)
            self._update(batch, status=ended, output_file_id=out, error_file_id=err, **{f"{ended}_at": now})

    def _one(self, batch: dict, number: int, raw: bytes, first: dict[str, int], files: tuple[str, str]) -> None:
        record = {"id": result_id(batch["id"], number), "custom_id": None, "response": None, "error": None}
        try:
            record["custom_id"], body = _parse(raw, batch["endpoint"], number, first)
        except BadLine as bad:
            record["custom_id"] = bad.custom_id
            record["error"] = {"code": "invalid_request", "message": str(bad)}
            return self._record(batch, files[1], record, "failed")
        tenant = batch.get("tenant", "")
        status, answer = self.send(batch["endpoint"], {**body, "priority": self.priority}, tenant)
        while status in RETRIED and self.serving():
            time.sleep(RETRY_PAUSE_S)  # refused for load: the pause is the back-off
            status, answer = self.send(batch["endpoint"], {**body, "priority": self.priority}, tenant)
        if status >= 500 and not self.serving():
            return  # answered by a server shutting down: it runs again after the restart
        record["response"] = {"status_code": status, "request_id": new_id("req_"), "body": answer}
        if status == 200:
            return self._record(batch, files[0], record, "completed")
        record["error"] = {"code": str(status), "message": (answer or {}).get("error", {}).get("message", "")}
        self._record(batch, files[1], record, "failed")

    def _record(self, batch: dict, file_id: str, record: dict, outcome: str) -> None:
        self.store.append(file_id, record)
        with self._cond:
            counts = dict(batch["request_counts"])
            counts[outcome] += 1
            self._update(batch, request_counts=counts)


def _public(batch: dict) -> dict:
    """A copy of the batch as the API shows it."""
    return {k: v for k, v in json.loads(json.dumps(batch)).items() if k not in PRIVATE}


def _lines(content: bytes) -> dict[int, bytes]:
    """The file's requests by line number (from 1); blank lines are none."""
    return {i: raw for i, raw in enumerate(content.split(b"\n"), 1) if raw.strip()}


def _first_lines(lines: dict[int, bytes]) -> dict[str, int]:
    """Each custom_id's first line: a later line with the same custom_id is an error."""
    first: dict[str, int] = {}
    for number, raw in lines.items():
        try:
            custom_id = json.loads(raw).get("custom_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(custom_id, str):
            first.setdefault(custom_id, number)
    return first


def _parse(raw: bytes, endpoint: str, number: int, first: dict[str, int]) -> tuple[str, dict]:
    """A line's custom_id and request body, or BadLine saying what is wrong."""
    try:
        line = json.loads(raw)
    except ValueError as err:
        raise BadLine(f"line {number} is not JSON: {err}", None) from None
    if not isinstance(line, dict):
        raise BadLine(f"line {number} is not a JSON object", None)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(f"line {number}: 'custom_id' must be a non-empty string", None)
    if first.get(custom_id) != number:
        raise BadLine(f"line {number}: custom_id {custom_id!r} is already used by line {first[custom_id]}", custom_id)
    unknown = set(line) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise BadLine(f"line {number}: unknown field {min(unknown)!r}", custom_id)
    if line.get("method") != "POST" or line.get("url") != endpoint:
        raise BadLine(f"line {number}: 'method' must be POST and 'url' the batch's endpoint {endpoint}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise BadLine(f"line {number}: 'body' must be a JSON object", custom_id)
    if body.get("stream"):
        raise BadLine(f"line {number}: a batch request cannot stream", custom_id)
    return custom_id, body
