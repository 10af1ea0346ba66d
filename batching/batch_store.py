"""The Batch API's files and batches on disk, under DATA_DIR, so that a batch survives a restart.

  DATA_DIR/files/<id>.json    a file's metadata (OpenAI's file object)
  DATA_DIR/files/<id>.data    its bytes: an uploaded JSONL, or a batch's output or errors, appended as
                              its requests finish, one line each, flushed and synced
  DATA_DIR/batches/<id>.json  a batch (OpenAI's batch object), replaced whole (write, then rename)

A batch's requests are its input file's lines; each result line's id ends in its line number, so
after a restart the lines without a result line are exactly those still to run (a result line
torn by a crash is cut off and its request run again).
"""

import json
import os
import threading
import time
import uuid
from pathlib import Path


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def result_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def line_of(record_id: str) -> int:
    return int(record_id.rsplit("_", 1)[1])


class BatchStore:
    def __init__(self, data_dir: str):
        self.files_dir, self.batches_dir = Path(data_dir) / "files", Path(data_dir) / "batches"
        self._lock = threading.Lock()  # appends to result files, and batch object replacements

    # --- files ------------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict:
        meta = {
            "id": file_id or new_id("file-"),
            "object": "file",
            "bytes": len(data),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        self.files_dir.mkdir(parents=True, exist_ok=True)  # at first use: a server never asked writes nothing
        self._data_path(meta["id"]).write_bytes(data)
        _replace(self.files_dir / f"{meta['id']}.json", meta)
        return meta

    def file(self, file_id: str) -> dict | None:
        path = self.files_dir / f"{_safe(file_id)}.json"
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        meta["bytes"] = self._data_path(file_id).stat().st_size  # a result file grows as its batch runs
        return meta

    def content(self, file_id: str) -> bytes:
        return self._data_path(file_id).read_bytes()

    def _data_path(self, file_id: str) -> Path:
        return self.files_dir / f"{_safe(file_id)}.data"

    # --- batches ----------------------------------------------------------------------------
    def save(self, batch: dict) -> None:
        with self._lock:
            self.batches_dir.mkdir(parents=True, exist_ok=True)
            _replace(self.batches_dir / f"{batch['id']}.json", batch)

    def batch(self, batch_id: str) -> dict | None:
        path = self.batches_dir / f"{_safe(batch_id)}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def batches(self) -> list[dict]:
        found = [json.loads(p.read_text()) for p in self.batches_dir.glob("batch_*.json")]
        return sorted(found, key=lambda b: (b["created_at"], b["id"]))

    def append(self, file_id: str, record: dict) -> None:
        """One result line, on disk before this returns."""
        line = (json.dumps(record) + "\n").encode()
        with self._lock, self._data_path(file_id).open("ab") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

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
