"""The Batch API's files and batches on disk, under DATA_DIR, so that a batch survives a restart.

  DATA_DIR/files/<id>.json    a file's metadata (OpenAI's file object, with its owner: never shown)
  DATA_DIR/files/<id>.data    its bytes: an uploaded JSONL, or a batch's output or errors, appended as
                              its requests finish, one line each, flushed and synced
  DATA_DIR/batches/<id>.json  a batch (OpenAI's batch object), replaced whole (write, then rename)

A batch's requests are its input file's lines; each result line's id ends in its line number, so
after a restart the lines without a result line are exactly those still to run (a result line
torn by a crash is cut off and its request run again).

Every file and batch has an owner: "tenant:<name>" for a key's tenant, "operator", or "shared" (api/tenants.py).
Files written before owners were kept count as the operator's. The files' metadata is held in memory
too, so that a tenant's stored bytes are summed without reading every file's JSON.
"""

import contextlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

PRIVATE = ("owner",)  # kept with a file, not shown
UNKNOWN_OWNER = "operator"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def result_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def line_of(record_id: str) -> int:
    return int(record_id.rsplit("_", 1)[1])


def public(obj: dict, private: tuple[str, ...] = PRIVATE) -> dict:
    """A copy of a stored object as the API shows it."""
    return {k: v for k, v in json.loads(json.dumps(obj)).items() if k not in private}


class BatchStore:
    def __init__(self, data_dir: str):
        self.files_dir, self.batches_dir = Path(data_dir) / "files", Path(data_dir) / "batches"
        self._lock = threading.Lock()  # the file index, appends to result files, batch object replacements
        self._files = {m["id"]: m for m in (json.loads(p.read_text()) for p in self.files_dir.glob("*.json"))}
        for meta in self._files.values():
            meta.setdefault("owner", UNKNOWN_OWNER)

    # --- files ------------------------------------------------------------------------------
    def add_file(
        self, data: bytes, filename: str, purpose: str, owner: str, expires_at: int | None, file_id: str | None = None
    ) -> dict:
        meta = {
            "id": file_id or new_id("file-"),
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "expires_at": expires_at,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "owner": owner,
        }
        self.files_dir.mkdir(parents=True, exist_ok=True)  # at first use: a server never asked writes nothing
        self._data_path(meta["id"]).write_bytes(data)
        with self._lock:
            _replace(self.files_dir / f"{meta['id']}.json", meta)
            self._files[meta["id"]] = meta
        return dict(meta)

    def file(self, file_id: str) -> dict | None:
        """A file's metadata (private fields included), its size as it is now; None if there is no such file."""
        with self._lock:
            meta = self._files.get(file_id)
            meta = None if meta is None else dict(meta)
        if meta is not None:
            meta["bytes"] = self._size(file_id)  # a result file grows as its batch runs
        return meta

    def files(self) -> list[dict]:
        with self._lock:
            ids = list(self._files)
        return [meta for meta in map(self.file, ids) if meta is not None]

    def owner_bytes(self, owner: str) -> int:
        """The bytes of every file `owner` has (uploads and batch results)."""
        return sum(meta["bytes"] for meta in self.files() if meta["owner"] == owner)

    def set_expiry(self, file_id: str, expires_at: int | None) -> None:
        with self._lock:
            meta = self._files.get(file_id)
            if meta is not None:
                meta["expires_at"] = expires_at
                _replace(self.files_dir / f"{file_id}.json", meta)

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            self._files.pop(file_id, None)
            for path in (self.files_dir / f"{_safe(file_id)}.json", self._data_path(file_id)):
                path.unlink(missing_ok=True)

    def content(self, file_id: str) -> bytes:
        return self._data_path(file_id).read_bytes()

    def _size(self, file_id: str) -> int:
        try:
            return self._data_path(file_id).stat().st_size
        except FileNotFoundError:
            return 0

    def _data_path(self, file_id: str) -> Path:
        return self.files_dir / f"{_safe(file_id)}.data"

    # --- batches ----------------------------------------------------------------------------
    def save(self, batch: dict) -> None:
        with self._lock:
            self.batches_dir.mkdir(parents=True, exist_ok=True)
            _replace(self.batches_dir / f"{batch['id']}.json", batch)

    def delete_batch(self, batch_id: str) -> None:
        (self.batches_dir / f"{_safe(batch_id)}.json").unlink(missing_ok=True)

    def batches(self) -> list[dict]:
        found = [json.loads(p.read_text()) for p in self.batches_dir.glob("batch_*.json")]
        for batch in found:
            batch.setdefault("owner", UNKNOWN_OWNER)
        return sorted(found, key=lambda b: (b["created_at"], b["id"]))

    def append(self, file_id: str, records: list[dict]) -> None:
        """Result lines, on disk before this returns; OSError if they could not be written (a full disk), and
        then nothing of them is left: a torn line would run into the next."""
        line = memoryview("".join(json.dumps(record) + "\n" for record in records).encode())
        with self._lock:
            fd = os.open(self._data_path(file_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                try:
                    while line:
                        line = line[os.write(fd, line) :]
                    os.fsync(fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)

    def done_lines(self, file_id: str) -> set[int]:
        """The input lines a result file has a record for; a torn last record (a crash) is cut off."""
        path = self._data_path(file_id)
        if not path.exists():
            path.touch()
            return set()
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with path.open("r+b") as out:
                out.truncate(end)
        return {line_of(json.loads(raw)["id"]) for raw in data[:end].splitlines() if raw.strip()}


def _safe(name: str) -> str:
    """An id from a URL names a file only if it is one of ours: letters, digits, '-' and '_'."""
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        return "-invalid-"
    return name


def _replace(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
