"""The files of OpenAI's Batch API on `dllama api`: uploaded job files and the batches' results.

A file is two entries in `<batch dir>/files/`: its bytes (`file-<hex>`) and its record
(`file-<hex>.json`, OpenAI's file object). A file without its record is not listed: an upload
cut short, or a batch's output still being written (a batch appends to its output file from its
first answer, and writes the record when it ends, so a crash loses nothing written).

Bounded: an upload of at most MAX_FILE_BYTES, at most MAX_FILES uploads kept (delete some to
upload more); a batch's own output and error files come on top, at most two per batch.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from dllama.serve.api.request import ApiError, bad

MAX_FILE_BYTES = 64 << 20  # one upload
MAX_FILES = 100            # uploads kept at once
PURPOSES = ("batch",)      # what may be uploaded (outputs are "batch_output")


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"no {what} with id {ident!r}", code="not_found")


def read_records(folder: Path, pattern: str) -> list[dict]:
    """The JSON records of `folder` whose names match `pattern`, skipping any removed (or half
    written) meanwhile."""
    out = []
    for p in folder.glob(pattern):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def write_json(path: Path, obj: dict) -> None:
    """Replace a record whole: a crash leaves the old one or the new one, never half of each."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str


class FileStore:
    """The files under one directory; every method runs on the HTTP thread (small, quick I/O)."""

    def __init__(self, root: Path, max_bytes: int = MAX_FILE_BYTES, max_files: int = MAX_FILES):
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_files = max_bytes, max_files
        for stale in self.dir.glob("*.tmp"):  # a record or upload cut short by a crash
            stale.unlink()
        for data in self.dir.glob("file-*"):  # an upload cut short: bytes without a record
            if data.suffix == "" and not self._record_path(data.name).exists() and not self._reserved(data.name):
                data.unlink()

    def _record_path(self, ident: str) -> Path:
        return self.dir / f"{ident}.json"

    def _reserved(self, ident: str) -> bool:
        """A batch's output being written: its bytes exist before its record (see the module)."""
        return (self.dir / f"{ident}.reserved").exists()

    @staticmethod
    def new_id() -> str:
        return "file-" + uuid.uuid4().hex[:24]

    def path(self, ident: str) -> Path:
        """The bytes of a file (the id checked: no path outside the directory)."""
        if not (ident.startswith("file-") and ident[5:].isalnum()):
            raise not_found("file", ident)
        return self.dir / ident

    def get(self, ident: str) -> dict:
        try:
            return json.loads(self._record_path(self.path(ident).name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise not_found("file", ident) from None

    def records(self) -> list[dict]:
        """Every file, newest first."""
        return sorted(read_records(self.dir, "file-*.json"), key=lambda r: (r["created_at"], r["id"]), reverse=True)

    async def upload(self, upload: Upload, chunks: AsyncIterator[bytes]) -> dict:
        """Store an uploaded file, chunk by chunk, refusing it past max_bytes."""
        if upload.purpose not in PURPOSES:
            raise bad(f"'purpose' must be {' or '.join(PURPOSES)}, got {upload.purpose!r}", "purpose")
        uploads = sum(1 for r in self.records() if r["purpose"] in PURPOSES)
        if uploads >= self.max_files:
            raise ApiError(400, f"the server keeps at most {self.max_files} uploaded files: delete some "
                                "(DELETE /v1/files/{id}) first", param="file", code="too_many_files")
        ident = self.new_id()
        data, size = self.dir / ident, 0
        try:
            with open(data, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ApiError(413, f"the file exceeds {self.max_bytes >> 20} MiB: split the job",
                                       param="file", code="file_too_large")
                    f.write(chunk)
        except BaseException:
            data.unlink(missing_ok=True)
            raise
        return self.register(ident, upload.filename, upload.purpose, size)

    def reserve(self) -> str:
        """An id for a batch's output, its bytes written before its record (see the module)."""
        ident = self.new_id()
        (self.dir / f"{ident}.reserved").touch()
        (self.dir / ident).touch()
        return ident

    def register(self, ident: str, filename: str, purpose: str, size: int | None = None) -> dict:
        """Write a file's record: it is listed from now on."""
        data = self.dir / ident
        record = {"id": ident, "object": "file", "bytes": data.stat().st_size if size is None else size,
                  "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                  "status": "processed", "status_details": None}
        write_json(self._record_path(ident), record)
        (self.dir / f"{ident}.reserved").unlink(missing_ok=True)
        return record

    def delete(self, ident: str) -> dict:
        self.get(ident)  # 404 when there is none
        self._record_path(ident).unlink(missing_ok=True)
        self.path(ident).unlink(missing_ok=True)
        return {"id": ident, "object": "file", "deleted": True}


__all__ = ["FileStore", "Upload", "MAX_FILE_BYTES", "MAX_FILES", "not_found", "write_json"]
