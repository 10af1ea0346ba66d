"""OpenAI's Batch API, run inside the server: each request of a batch goes through the server's own
endpoint (the same code as over HTTP), at the lowest priority, so a batch fills idle capacity and
yields to interactive requests within a step or two.

Owners. Every file and batch belongs to the owner of the key that made it (api/tenants.py: a key's
tenant, the operator, or the shared owner); the API shows an owner its own alone, the operator all.
A batch's requests count for the tenant that created it (fair share: generate/fair_share.py).

Scheduling. BATCH_IN_FLIGHT requests of all batches run at once, shared between the owners in turn:
each free slot goes to the owner with the fewest requests in flight (ties: the one served longest
ago), and within an owner to its oldest batch. So one tenant's thousand batches hold only its own
back, and a batch created beside them starts at once.

Every input line ends in exactly one result line: the output file (status 200) or the error file (a
bad line, with its custom_id when it has one; an endpoint's 4xx or 5xx). A refusal for load (429,
503, 504) is tried again after 1, 2, 4, then every 8 seconds, at most the batch's max_retries times
(BATCH_MAX_RETRIES when it was created); then the line fails with that answer. A result that cannot
be written (a full disk) fails its line with the error recorded in the error file (code
"write_failed"); when that cannot be written either, in the batch's `errors`, and the batch ends
"failed" (the line, having no result, runs again after a restart).

When the server stops, requests not answered are left without a result, and after the restart
(batch_store.py) they run again: nothing lost, nothing twice. Cancelling stops new requests; those in
flight finish, and the batch is `cancelled` with what it has. A batch not ended by its expires_at (its
24-hour window) takes no more lines: each line left gets an error line (code "batch_expired", as
OpenAI's), and it ends `expired` with what it has.

Retention. An upload expires BATCH_RETENTION_S after it was made, a batch and its result files that long
after the batch ended (each keeps the retention it was made under): from then on they are 404, and the
runner removes them from DATA_DIR (a file an open batch uses, once that batch ends).
"""

from __future__ import annotations  # BatchJobs.list shadows the builtin in the annotations after it

import itertools
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from batching.batch_store import BatchStore, new_id, public, result_id

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
RETRIED = (429, 503, 504)  # refused for load, or timed out in the queue: not the request's fault
PAUSES_S = (1.0, 2.0, 4.0, 8.0)  # before each retry of a line refused for load; the last repeats
RUNNABLE = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_S = 24 * 3600  # completion_window "24h"
MAX_BATCH_ERRORS = 100  # entries kept in a batch's `errors`

Send = Callable[[str, dict, str], tuple[int, dict]]  # (endpoint, body, tenant) -> (status, JSON answer)
PRIVATE = ("tenant", "owner", "retention_s", "max_retries")  # kept with a batch, not shown
Action = Callable[[], None]


class BadLine(ValueError):
    def __init__(self, message: str, custom_id: str | None):
        super().__init__(message)
        self.custom_id = custom_id


class OverQuota(Exception):
    """An owner's stored bytes or open batches would pass their limit."""


class NoSuchFile(LookupError):
    """No file of that id that the caller may use."""


class FileInUse(Exception):
    """A batch not yet ended uses the file."""


@dataclass(eq=False)
class _Run:
    """A batch the runner has opened: its lines, those not yet sent, its requests in flight."""

    batch: dict
    lines: dict[int, bytes]
    first: dict[str, int]  # each custom_id's first line
    todo: deque[int]
    out: str
    err: str
    in_flight: int = 0
    expired: list[int] | None = None  # lines never sent when its window closed
    unwritten: bool = False  # a line's result could be written nowhere: the batch fails

    @property
    def owner(self) -> str:
        return self.batch["owner"]


class BatchJobs:
    def __init__(self, store: BatchStore, send: Send, serving: Callable[[], bool], priority: int, in_flight: int):
        self.store, self.send, self.serving = store, send, serving
        self.priority, self.in_flight = priority, in_flight
        self._cond = threading.Condition()  # guards what follows; the runner waits on it for work
        self._batches = {b["id"]: _with_terms(b) for b in store.batches()}  # authoritative; each change is saved
        self._runs: dict[str, _Run] = {}  # opened batches, by id
        self._sending = 0  # requests in flight, all batches
        self._last_turn: dict[str, int] = {}  # owner -> when it last got a slot
        self._turns = itertools.count()
        self._due = 0.0  # when something may next expire (Unix time): sweep then
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="batch-request")
        self._thread = threading.Thread(target=self._run, name="batch-jobs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- request threads: files ---------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, owner: str, retention_s: float, max_bytes: int) -> dict:
        """An upload of `owner`'s, unless it would take the owner's files past `max_bytes` (0: no limit)."""
        with self._cond:  # checked and written together: two uploads cannot both pass the check
            stored = self.store.owner_bytes(owner)
            if max_bytes and stored + len(data) > max_bytes:
                message = f"this key's files hold {stored} bytes; {len(data)} more would pass {max_bytes}"
                raise OverQuota(f"{message} (BATCH_TENANT_MAX_BYTES): delete some first")
            meta = self.store.add_file(data, filename, "batch", owner, _expiry(time.time(), retention_s))
            self._expect(meta["expires_at"])
        return public(meta)

    def file(self, file_id: str, owner: str | None) -> dict | None:
        """The file as shown, if it exists, has not expired, and is `owner`'s (None: anyone's, for the operator)."""
        meta = self.store.file(file_id)
        if meta is None or _expired(meta, time.time()) or owner not in (None, meta["owner"]):
            return None
        return public(meta)

    def files(self, owner: str | None) -> list[dict]:
        return [f for f in (self.file(meta["id"], owner) for meta in self.store.files()) if f is not None]

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        """Remove the file (False: there is none `owner` may see); FileInUse while a batch not ended uses it."""
        with self._cond:
            if self.file(file_id, owner) is None:
                return False
            user = next((b["id"] for b in self._open_batches() if file_id in _file_ids(b)), None)
            if user is not None:
                raise FileInUse(f"the file is used by batch {user}, which has not ended: cancel it first")
            self.store.delete_file(file_id)
            return True

    # --- request threads: batches -------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, metadata: dict | None, *, tenant: str, owner: str,
               scope: str | None, retention_s: float, max_retries: int, max_open: int) -> dict:  # fmt: skip
        """A batch of `owner`'s over a file `scope` may use (None: any): NoSuchFile, ValueError for a file that is
        no batch input, OverQuota past `max_open` batches not yet ended (0: no limit). `tenant`: whom its
        requests count for ("": each names its own)."""
        with self._cond:
            meta = self.file(input_file_id, scope)
            if meta is None:
                raise NoSuchFile(input_file_id)
            if meta["purpose"] != "batch":
                raise ValueError(f"'input_file_id' must name a file of purpose 'batch', not {meta['purpose']!r}")
            if max_open and (n := sum(b["owner"] == owner for b in self._open_batches())) >= max_open:
                raise OverQuota(f"this key has {n} batches not yet ended, BATCH_TENANT_MAX_BATCHES: wait for one")
            batch = self._new_batch(input_file_id, endpoint, metadata, tenant, owner, retention_s, max_retries)
            for kind, file_id in _files(batch).items():
                self.store.add_file(b"", f"{batch['id']}_{kind}.jsonl", f"batch_{kind}", owner, None, file_id)
            self._batches[batch["id"]] = batch
            self._save(batch)
            self._expect(batch["expires_at"])
            self._cond.notify()  # work for the runner
        return public(batch, PRIVATE)

    def _new_batch(self, input_file_id: str, endpoint: str, metadata: dict | None, tenant: str, owner: str,
                   retention_s: float, max_retries: int) -> dict:  # fmt: skip
        now = int(time.time())
        return {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_S,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(_lines(self.store.content(input_file_id))), "completed": 0, "failed": 0},
            "metadata": metadata,
            "tenant": tenant,  # "": its requests name their own (their `user`), as any request does
            "owner": owner,
            "retention_s": retention_s,
            "max_retries": max_retries,
        }

    def get(self, batch_id: str, owner: str | None) -> dict | None:
        with self._cond:
            batch = self._batches.get(batch_id)
            if batch is None or owner not in (None, batch["owner"]) or _gone(batch, time.time()):
                return None
            return public(batch, PRIVATE)

    def list(self, owner: str | None) -> list[dict]:
        with self._cond:
            found = [self.get(batch_id, owner) for batch_id in self._batches]
        return [b for b in found if b is not None]

    def cancel(self, batch_id: str, owner: str | None) -> dict | None:
        with self._cond:
            batch = self._batches.get(batch_id)
            if self.get(batch_id, owner) is not None and batch["status"] in ("validating", "in_progress"):
                self._update(batch, status="cancelling", cancelling_at=int(time.time()))
                self._cond.notify()  # the runner ends it once its requests in flight are answered
            return self.get(batch_id, owner)

    # --- the runner thread --------------------------------------------------------------------
    def _run(self) -> None:
        while self.serving():
            with self._cond:
                while (action := self._next(time.time())) is None:
                    self._cond.wait(timeout=max(0.0, self._due - time.time()) if self._due < math.inf else None)
                    if not self.serving():
                        return  # the server is stopping: what is left runs after the restart
            try:
                action()
            except Exception:  # one batch's trouble must not take the runner with it
                log.exception("the Batch API's runner")

    def _next(self, now: float) -> Action | None:
        """What the runner does next (under the lock): sweep what expired, end a batch that is done, open one,
        or send a line; None: nothing until a change (or the next expiry)."""
        if now >= self._due:
            self._sweep(now)
        for batch in self._open_batches():
            run = self._runs.get(batch["id"])
            if run is None and batch["status"] == "cancelling":
                return lambda batch=batch: self._finish(batch, None)
            if run is not None and now >= batch["expires_at"] and run.todo:
                run.expired, run.todo = list(run.todo), deque()
            if run is not None and batch["status"] == "cancelling":
                run.todo.clear()
            if run is not None and not run.todo and not run.in_flight:
                return lambda batch=batch, run=run: self._finish(batch, run)
        if self._sending >= self.in_flight:
            return None
        return self._next_line()

    def _next_line(self) -> Action | None:
        """A slot for the owner with the fewest requests in flight (ties: served longest ago): its oldest opened
        batch's next line, or its oldest batch not yet opened."""
        waiting: dict[str, list[dict]] = {}
        for batch in self._open_batches():
            run = self._runs.get(batch["id"])
            if (run is not None and run.todo) or (run is None and batch["status"] != "cancelling"):
                waiting.setdefault(batch["owner"], []).append(batch)
        if not waiting:
            return None
        flying = {owner: sum(r.in_flight for r in self._runs.values() if r.owner == owner) for owner in waiting}
        owner = min(waiting, key=lambda o: (flying[o], self._last_turn.get(o, -1)))
        batch = next((b for b in waiting[owner] if b["id"] in self._runs), waiting[owner][0])
        run = self._runs.get(batch["id"])
        if run is None:
            return lambda: self._open(batch)
        self._last_turn[owner] = next(self._turns)
        number = run.todo.popleft()
        run.in_flight += 1
        self._sending += 1
        return lambda: self._pool.submit(self._one, run, number)

    def _open(self, batch: dict) -> None:
        """Read a batch's lines and which have a result already (a restart), and start it."""
        files = _files(batch)
        try:
            lines = _lines(self.store.content(batch["input_file_id"]))
            completed, failed = self.store.done_lines(files["output"]), self.store.done_lines(files["errors"])
        except OSError as err:  # its input removed by hand, or unreadable
            with self._cond:
                self._fail(batch, "file_unreadable", f"the batch's files cannot be read: {err}")
            return
        todo = deque(number for number in lines if number not in completed | failed)
        run = _Run(batch, lines, _first_lines(lines), todo, files["output"], files["errors"])
        with self._cond:
            self._runs[batch["id"]] = run
            # The counts as the result files have them: a server killed between writing a result and saving the
            # batch's counts left that result uncounted
            counts = {**batch["request_counts"], "completed": len(completed), "failed": len(failed)}
            if counts != batch["request_counts"]:
                self._update(batch, request_counts=counts)
            if batch["status"] == "validating":
                self._update(batch, status="in_progress", in_progress_at=int(time.time()))

    def _finish(self, batch: dict, run: _Run | None) -> None:
        """End a batch: an error line for each line its window closed on, then its ending, and its retention."""
        if run is not None and run.expired:
            expired = [_expired_record(batch, number, run) for number in run.expired]
            if self._write(run, run.err, expired) is not None:
                run.unwritten = True
        now = int(time.time())
        with self._cond:
            self._runs.pop(batch["id"], None)
            if run is not None and run.expired:
                self._count(batch, "failed", len(run.expired))
            ended = "cancelled" if batch["status"] == "cancelling" else "expired" if run and run.expired else None
            ended = ended or ("failed" if run is not None and run.unwritten else "completed")
            files = _files(batch)
            self._update(batch, status="finalizing", finalizing_at=now)
            self._update(batch, status=ended, output_file_id=files["output"], error_file_id=files["errors"],
                         **{f"{ended}_at": now})  # fmt: skip
            self._keep_results(batch, now)

    def _fail(self, batch: dict, code: str, message: str) -> None:
        self._add_error(batch, code, message, None)
        now = int(time.time())
        self._update(batch, status="failed", failed_at=now)
        self._keep_results(batch, now)

    def _keep_results(self, batch: dict, ended_at: int) -> None:
        """An ended batch's result files expire with it, its retention after it ended."""
        expires_at = _expiry(ended_at, batch["retention_s"])
        for file_id in _files(batch).values():
            self.store.set_expiry(file_id, expires_at)
        self._expect(expires_at)

    def _sweep(self, now: float) -> None:
        """Remove the ended batches and the files past their retention (not a file an open batch uses), and
        note when the next one is due."""
        due = math.inf
        for batch in list(self._batches.values()):
            removal = _removal(batch)
            if removal <= now:
                del self._batches[batch["id"]]
                self.store.delete_batch(batch["id"])
            due = min(due, removal if removal > now else math.inf)
        for batch in self._open_batches():  # a window closing: the runner ends it then
            due = min(due, batch["expires_at"] if batch["expires_at"] > now else math.inf)
        used = {file_id for batch in self._open_batches() for file_id in _file_ids(batch)}
        for meta in self.store.files():
            expires = meta.get("expires_at") or math.inf
            if expires <= now and meta["id"] not in used:
                self.store.delete_file(meta["id"])
            elif expires > now:
                due = min(due, expires)
        self._due = due

    def _expect(self, when: float | None) -> None:
        """Something expires at `when` (None: never): the runner's next sweep is then at the latest."""
        if when is not None and when < self._due:
            self._due = when
            self._cond.notify()

    # --- a batch's requests (the pool's threads) ----------------------------------------------
    def _one(self, run: _Run, number: int) -> None:
        try:
            result = self._result(run, number)
            if result is not None:
                record, outcome = result
                written = self._write(run, run.out if outcome == "completed" else run.err, [record])
                self._record_outcome(run, number, record, outcome, written)
        except Exception:  # one line's trouble is its own
            log.exception("batch %s line %d", run.batch["id"], number)
        finally:
            with self._cond:
                run.in_flight -= 1
                self._sending -= 1
                self._cond.notify()

    def _result(self, run: _Run, number: int) -> tuple[dict, str] | None:
        """The line's result record and outcome ("completed" or "failed"); None when the server stopped under it."""
        batch = run.batch
        record = {"id": result_id(batch["id"], number), "custom_id": None, "response": None, "error": None}
        try:
            record["custom_id"], body = _parse(run.lines[number], batch["endpoint"], number, run.first)
        except BadLine as bad:
            record["custom_id"] = bad.custom_id
            record["error"] = {"code": "invalid_request", "message": str(bad)}
            return record, "failed"
        status, answer = self._send(batch, body)
        if status >= 500 and not self.serving():
            return None  # answered by a server shutting down: it runs again after the restart
        record["response"] = {"status_code": status, "request_id": new_id("req_"), "body": answer}
        if status == 200:
            return record, "completed"
        record["error"] = {"code": str(status), "message": (answer or {}).get("error", {}).get("message", "")}
        return record, "failed"

    def _send(self, batch: dict, body: dict) -> tuple[int, dict]:
        """The line's request, tried again while refused for load, backing off, at most max_retries times."""
        request, tenant = {**body, "priority": self.priority}, batch.get("tenant", "")
        for attempt in itertools.count():
            status, answer = self.send(batch["endpoint"], request, tenant)
            if status not in RETRIED or attempt >= batch["max_retries"] or not self.serving():
                return status, answer
            time.sleep(PAUSES_S[min(attempt, len(PAUSES_S) - 1)])

    def _write(self, run: _Run, file_id: str, records: list[dict]) -> OSError | None:
        """Append the records; the error if they could not be written."""
        try:
            self.store.append(file_id, records)
        except OSError as err:
            log.error("batch %s: a result could not be written to %s: %s", run.batch["id"], file_id, err)
            return err
        return None

    def _record_outcome(self, run: _Run, number: int, record: dict, outcome: str, failed: OSError | None) -> None:
        """Count the line; a result that could not be written fails it, said in the error file, or else in the
        batch's errors (then the line has no result, and the batch fails)."""
        if failed is not None and outcome == "completed":
            message = f"the result could not be written: {failed}"
            outcome, record = "failed", {**record, "error": {"code": "write_failed", "message": message}}
            failed = self._write(run, run.err, [record])
        with self._cond:
            if failed is not None:
                run.unwritten = True
                self._add_error(run.batch, "write_failed", f"no result could be written: {failed}", number)
                return
            self._count(run.batch, outcome, 1)

    # --- bookkeeping (under the lock) ---------------------------------------------------------
    def _open_batches(self) -> list[dict]:
        return [b for b in self._batches.values() if b["status"] in RUNNABLE]

    def _count(self, batch: dict, outcome: str, n: int) -> None:
        counts = dict(batch["request_counts"])
        counts[outcome] += n
        self._update(batch, request_counts=counts)

    def _add_error(self, batch: dict, code: str, message: str, line: int | None) -> None:
        errors = batch["errors"] or {"object": "list", "data": []}
        if len(errors["data"]) < MAX_BATCH_ERRORS:
            errors["data"].append({"code": code, "message": message, "param": None, "line": line})
        self._update(batch, errors=errors)

    def _update(self, batch: dict, **changes) -> None:
        """Change a batch and save it (the caller holds _cond)."""
        batch.update(changes)
        self._save(batch)

    def _save(self, batch: dict) -> None:
        try:
            self.store.save(batch)
        except OSError as err:  # a full disk: the batch as held here stays right, and is saved at its next change
            log.error("batch %s could not be saved: %s", batch["id"], err)


def _with_terms(batch: dict) -> dict:
    """A batch made before each kept its own terms: kept until deleted, and BATCH_MAX_RETRIES's default."""
    batch.setdefault("retention_s", 0)
    batch.setdefault("max_retries", 6)
    return batch


def _files(batch: dict) -> dict[str, str]:
    hex_id = batch["id"].removeprefix("batch_")
    return {"output": f"file-{hex_id}-output", "errors": f"file-{hex_id}-errors"}


def _file_ids(batch: dict) -> set[str]:
    return {batch["input_file_id"], *_files(batch).values()}


def _expiry(now: float, retention_s: float) -> int | None:
    return int(now + retention_s) if retention_s else None


def _expired(meta: dict, now: float) -> bool:
    return meta.get("expires_at") is not None and meta["expires_at"] <= now


def _removal(batch: dict) -> float:
    """When an ended batch is removed (inf: it has not ended, or is kept)."""
    ended_at = batch.get(f"{batch['status']}_at") if batch["status"] not in RUNNABLE else None
    return ended_at + batch["retention_s"] if ended_at and batch["retention_s"] else math.inf


def _gone(batch: dict, now: float) -> bool:
    return _removal(batch) <= now


def _expired_record(batch: dict, number: int, run: _Run) -> dict:
    try:
        custom_id = json.loads(run.lines[number]).get("custom_id")
    except (ValueError, AttributeError):
        custom_id = None
    message = "This request could not be executed before the completion window expired."
    return {
        "id": result_id(batch["id"], number),
        "custom_id": custom_id if isinstance(custom_id, str) else None,
        "response": None,
        "error": {"code": "batch_expired", "message": message},
    }


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
