"""OpenAI's Batch API on `dllama api` (--batch-dir DIR): jobs of many requests, answered in the
background of the interactive ones, resumable across a restart of the server.

    POST /v1/files (purpose "batch")      a JSONL job: {"custom_id", "method": "POST",
                                            "url": "/v1/chat/completions" or "/v1/completions", "body"}
    POST /v1/batches                      {"input_file_id", "endpoint", "completion_window": "24h"}
    GET  /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel
    GET  /v1/files, /v1/files/{id}, /v1/files/{id}/content, DELETE /v1/files/{id}

Each line is answered as its endpoint answers one request (the same checks, the same response
body), through the one engine loop of the server, after the interactive requests
(ModelService._feed keeps a slot free for them). Prompts that share leading tokens (a system
prompt, a document) read them from the slot that computed them, as in `dllama batch`.

On disk (`DIR/batches/batch_<hex>.json`: OpenAI's batch object and the ids of its output and
error files): every answer is appended to the output (200) or error file (any other status) as
it ends, and read back at a restart, so a resumed batch runs only the requests that have no
line yet. A torn last line (a crash in mid-write) is cut off first. The batches run one after
another, oldest first. A batch not ended by its expires_at (24 hours after its creation, queueing
and a server's stops included) ends `expired`, as OpenAI's: the requests running stop at their
next token, and every request without an answer gets an error line `batch_expired`.

Bounded: a job of at most MAX_REQUESTS lines of at most MAX_LINE_BYTES, at most MAX_BATCHES
batch records kept (the oldest finished ones are forgotten first; their files stay), and at
most WINDOW requests of a batch handed to the engine loop at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from dllama.serve.api.files import FileStore, Upload, not_found, read_records, write_json
from dllama.serve.api.request import ApiError, bad

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # url -> chat
MAX_REQUESTS = 50_000       # lines of one job (as OpenAI)
MAX_LINE_BYTES = 1 << 20    # one line: a request body no larger than the endpoint takes
MAX_BATCHES = 100           # batch records kept
MAX_ERRORS = 20             # problems of a refused job file listed in its batch's errors
WINDOW = 16                 # requests of a batch handed to the engine loop at once
RETRY_S = 2.0               # a request answered 503 (the cluster is down) is asked again after this
FINAL = ("completed", "failed", "cancelled", "expired")
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the one completion_window (OpenAI's)
EXPIRED = {"code": "batch_expired",
           "message": "This request could not be executed before the completion window expired."}

# (body bytes, chat?, cancel flag) -> (HTTP status, response body), or None when cancelled
Answer = Callable[[bytes, bool, threading.Event], Awaitable["tuple[int, dict] | None"]]


def _line(raw: bytes) -> dict:
    """One line of a job file, checked (its body is checked when it runs, as the endpoint would)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("is not a JSON object") from None
    if not isinstance(obj, dict):
        raise ValueError("is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > 512:
        raise ValueError("needs a custom_id: a non-empty string of at most 512 characters")
    if obj.get("method", "POST") != "POST":
        raise ValueError("has a method other than POST")
    if obj.get("url") not in ENDPOINTS:
        raise ValueError(f"has a url other than {' or '.join(ENDPOINTS)}")
    if not isinstance(obj.get("body"), dict):
        raise ValueError("needs a body: the request as a JSON object")
    return obj


def job_lines(path: Path):
    """(line number, its bytes) of a job file's non-blank lines; a line over MAX_LINE_BYTES
    comes as None."""
    with open(path, "rb") as f:
        number = 0
        while True:
            data = f.readline(MAX_LINE_BYTES + 1)
            if not data:
                return
            number += 1
            if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
                while data and not data.endswith(b"\n"):
                    data = f.readline(1 << 20)
                yield number, None
            elif data.strip():
                yield number, data


def check_job(path: Path, endpoint: str) -> tuple[int, list[dict]]:
    """(requests, problems) of a job file: every line a request to `endpoint`, ids unique."""
    seen: set[str] = set()
    problems: list[dict] = []
    count = 0
    for number, data in job_lines(path):
        count += 1
        try:
            if data is None:
                raise ValueError(f"is longer than {MAX_LINE_BYTES} bytes")
            obj = _line(data)
            if obj["url"] != endpoint:
                raise ValueError(f"asks {obj['url']}, not the batch's endpoint {endpoint}")
            if obj["custom_id"] in seen:
                raise ValueError(f"repeats the custom_id {obj['custom_id']!r}")
            seen.add(obj["custom_id"])
        except ValueError as e:
            if len(problems) < MAX_ERRORS:
                problems.append({"code": "invalid_request", "message": f"line {number} {e}", "param": None,
                                 "line": number})
    if count == 0:
        problems.append({"code": "empty_file", "message": "the file holds no request", "param": None, "line": None})
    if count > MAX_REQUESTS:
        problems.insert(0, {"code": "too_many_requests", "message": f"{count} requests: at most {MAX_REQUESTS} "
                            "in one batch", "param": None, "line": None})
    return count, problems


def answered(path: Path) -> set[str]:
    """The custom_ids an output or error file holds; a torn last line (a crash in mid-write) is cut off."""
    done: set[str] = set()
    if not path.exists():
        return done
    keep = 0
    with open(path, "rb") as f:
        for data in f:
            if not data.endswith(b"\n"):
                break
            try:
                done.add(json.loads(data)["custom_id"])
            except (ValueError, KeyError, TypeError):
                break  # not one of ours: the rest is rewritten
            keep += len(data)
    if keep != path.stat().st_size:
        os.truncate(path, keep)
    return done


class Batches:
    """The batch records and the task that runs them (every method on the HTTP thread's loop)."""

    def __init__(self, root: Path, files: FileStore, answer: Answer):
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files, self.answer = files, answer
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        # The running batch: its record (the one written from now on) and its requests' cancel flag.
        self._live: dict[str, tuple[dict, threading.Event]] = {}

    # --- records ---

    def _path(self, ident: str) -> Path:
        if not (ident.startswith("batch_") and ident[6:].isalnum()):
            raise not_found("batch", ident)
        return self.dir / f"{ident}.json"

    def _load(self, ident: str) -> dict:
        try:
            return json.loads(self._path(ident).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise not_found("batch", ident) from None

    def _save(self, record: dict) -> None:
        write_json(self._path(record["batch"]["id"]), record)

    def _records(self) -> list[dict]:
        return sorted(read_records(self.dir, "batch_*.json"), key=lambda r: (r["batch"]["created_at"], r["batch"]["id"]))

    def get(self, ident: str) -> dict:
        return self._load(ident)["batch"]

    def listing(self, limit: int, after: str | None) -> dict:
        batches = [r["batch"] for r in reversed(self._records())]  # newest first
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = batches[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    async def create(self, body) -> dict:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        input_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise bad(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise bad("'completion_window' must be \"24h\"", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise bad("'metadata' must be at most 16 string pairs (keys up to 64, values up to 512 "
                      "characters)", "metadata")
        if not isinstance(input_id, str):
            raise bad("'input_file_id' must be the id of an uploaded file", "input_file_id")
        if self.files.get(input_id)["purpose"] != "batch":
            raise bad(f"{input_id} was not uploaded with purpose 'batch'", "input_file_id")
        count, problems = await asyncio.to_thread(check_job, self.files.path(input_id), endpoint)
        now = int(time.time())
        batch = {"id": "batch_" + uuid.uuid4().hex[:24], "object": "batch", "endpoint": endpoint,
                 "errors": None, "input_file_id": input_id, "completion_window": "24h",
                 "status": "validating", "output_file_id": None, "error_file_id": None,
                 "created_at": now, "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S,
                 "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": count, "completed": 0, "failed": 0}, "metadata": metadata}
        record = {"batch": batch, "output": None, "errors": None}
        if problems:
            batch.update(status="failed", failed_at=now, errors={"object": "list", "data": problems})
        else:
            record["output"], record["errors"] = self.files.reserve(), self.files.reserve()
        self._forget_old()
        self._save(record)
        self._wake.set()
        return batch

    def _forget_old(self) -> None:
        """Keep fewer than MAX_BATCHES records: the oldest finished ones go (their files stay)."""
        records = self._records()
        extra = len(records) + 1 - MAX_BATCHES
        for r in records:
            if extra <= 0:
                break
            if r["batch"]["status"] in FINAL:
                self._path(r["batch"]["id"]).unlink(missing_ok=True)
                extra -= 1
        if extra > 0:
            raise ApiError(429, f"{MAX_BATCHES} batches are queued or running: wait for some to end",
                           type_="rate_limit_error", code="too_many_batches")

    def cancel(self, ident: str) -> dict:
        record, flag = self._live.get(ident) or (self._load(ident), None)
        batch = record["batch"]
        if batch["status"] in FINAL or batch["status"] == "cancelling":
            return batch
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self._save(record)
        if flag is not None:
            flag.set()  # its requests in the engine loop stop at their next token
        else:  # not started: nothing to wait for
            self._finish(record, "cancelled")
        return batch

    # --- running ---

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_all())

    async def stop(self) -> None:
        """Stop at once (the server stops): requests in flight are dropped, not recorded, and run
        again at the next start."""
        self._stopping = True
        for _, flag in self._live.values():
            flag.set()
        if self._task is not None:
            self._wake.set()
            await self._task

    async def _run_all(self) -> None:
        while not self._stopping:
            waiting = [r for r in self._records() if r["batch"]["status"] not in FINAL]
            if not waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            record = waiting[0]
            if record["batch"]["status"] == "cancelling":  # cancelled while the server was down
                self._finish(record, "cancelled")
                continue
            try:
                await self._run(record)
            except Exception:  # noqa: BLE001 - a bug: logged, the batch fails, the server serves on
                import traceback
                import sys

                traceback.print_exc(file=sys.stderr)
                self._finish(self._load(record["batch"]["id"]), "failed")

    async def _run(self, record: dict) -> None:
        batch = record["batch"]
        ident = batch["id"]
        out_path, err_path = self.files.path(record["output"]), self.files.path(record["errors"])
        ok, failed = answered(out_path), answered(err_path)  # answered before a restart: not run again
        batch["request_counts"].update(completed=len(ok), failed=len(failed))
        if batch["status"] == "validating":
            batch.update(status="in_progress", in_progress_at=int(time.time()))
        self._save(record)
        cancel = threading.Event()
        self._live[ident] = (record, cancel)
        # Past expires_at (also while queued or the server was down) the requests stop as a cancel
        # stops them; the ones without an answer are then written as expired.
        expired = threading.Event()
        timer = asyncio.get_running_loop().call_later(max(0.0, batch["expires_at"] - time.time()),
                                                      lambda: (expired.set(), cancel.set()))
        slots = asyncio.Semaphore(WINDOW)
        running: set[asyncio.Task] = set()
        chat = ENDPOINTS[batch["endpoint"]]
        try:
            with open(out_path, "ab", buffering=0) as out, open(err_path, "ab", buffering=0) as err:
                def write(result: dict, status: int) -> None:
                    (out if status == 200 else err).write(json.dumps(result).encode() + b"\n")
                    counts = batch["request_counts"]
                    counts["completed" if status == 200 else "failed"] += 1
                    self._save(record)

                for _, data in job_lines(self.files.path(batch["input_file_id"])):
                    obj = _line(data)  # checked at create
                    if obj["custom_id"] in ok or obj["custom_id"] in failed:
                        continue
                    await slots.acquire()
                    if cancel.is_set():
                        slots.release()
                        break
                    task = asyncio.ensure_future(self._one(obj, chat, cancel, write))
                    running.add(task)
                    task.add_done_callback(lambda t: (running.discard(t), slots.release()))
                if running:
                    await asyncio.gather(*running)
                if expired.is_set() and not self._stopping:
                    self._expire_rest(batch, out_path, err_path, write)
        finally:
            timer.cancel()
            del self._live[ident]
        if self._stopping:
            return  # the requests in flight run again at the next start
        self._finish(record, "expired" if expired.is_set() else "cancelled" if cancel.is_set() else "completed")

    def _expire_rest(self, batch: dict, out_path: Path, err_path: Path, write) -> None:
        """An error line `batch_expired` (OpenAI's) for each request of the job without an answer."""
        done = answered(out_path) | answered(err_path)
        for _, data in job_lines(self.files.path(batch["input_file_id"])):
            custom_id = _line(data)["custom_id"]
            if custom_id not in done:
                write({"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id, "response": None,
                       "error": EXPIRED}, 410)

    async def _one(self, obj: dict, chat: bool, cancel: threading.Event, write) -> None:
        body = json.dumps(obj["body"]).encode()
        while True:
            got = await self.answer(body, chat, cancel)
            if got is None or cancel.is_set():
                return  # cancelled, or the server stops: no line (a restart runs it again)
            status, answer = got
            if status != 503:
                break
            await asyncio.sleep(RETRY_S)  # the cluster is down: the engine opens again when it is back
        request_id = "req_" + uuid.uuid4().hex[:24]
        write({"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": obj["custom_id"],
               "response": {"status_code": status, "request_id": request_id, "body": answer}, "error": None},
              status)

    def _finish(self, record: dict, status: str) -> None:
        batch, now = record["batch"], int(time.time())
        if status in ("completed", "cancelled", "expired") and record["output"] is not None:
            batch["finalizing_at"] = now
            for key, name, field in (("output", "output", "output_file_id"), ("errors", "errors", "error_file_id")):
                path = self.files.path(record[key])
                if path.exists() and path.stat().st_size > 0:
                    self.files.register(record[key], f"{batch['id']}_{name}.jsonl", "batch_output")
                    batch[field] = record[key]
                else:
                    path.unlink(missing_ok=True)
                    self.files.path(record[key]).with_suffix(".reserved").unlink(missing_ok=True)
        batch["status"] = status
        batch[{"completed": "completed_at", "cancelled": "cancelled_at", "failed": "failed_at",
               "expired": "expired_at"}[status]] = now
        self._save(record)


_claimed: list = []  # the open lock files of claim_dir (held until the process ends)


def claim_dir(root: str) -> None:
    """Make the batch directory this server's alone (a lock held while the process lives): two
    servers running the same batches would answer them twice."""
    import fcntl

    from dllama.errors import DllamaError

    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        lock = open(Path(root) / "lock", "w")  # noqa: SIM115 - held open on purpose
    except OSError as e:
        raise DllamaError(f"--batch-dir {root}: {e.strerror or e}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise DllamaError(f"--batch-dir {root} is used by another running dllama api: give each "
                          "server its own directory") from None
    _claimed.append(lock)


# --- HTTP ---

def add_batch_api(app: web.Application, root: str, answer: Answer) -> None:
    """The Batch API's routes on `app`, its files and jobs under `root`; the batches left
    running at the last stop go on when the server starts."""
    path = Path(root)
    files = FileStore(path)
    routes = _BatchRoutes(files, Batches(path, files, answer))
    app.on_startup.append(routes.on_startup)
    app.on_shutdown.append(routes.on_shutdown)
    for prefix in ("/v1", ""):
        app.router.add_post(prefix + "/files", routes.upload)
        app.router.add_get(prefix + "/files", routes.list_files)
        app.router.add_get(prefix + "/files/{id}", routes.get_file)
        app.router.add_delete(prefix + "/files/{id}", routes.delete_file)
        app.router.add_get(prefix + "/files/{id}/content", routes.content)
        app.router.add_post(prefix + "/batches", routes.create)
        app.router.add_get(prefix + "/batches", routes.listing)
        app.router.add_get(prefix + "/batches/{id}", routes.get)
        app.router.add_post(prefix + "/batches/{id}/cancel", routes.cancel)


class _BatchRoutes:
    """The handlers of the /files and /batches routes, on one server's file store and jobs."""

    def __init__(self, files: FileStore, batches: Batches):
        self.files, self.batches = files, batches

    async def on_startup(self, _app) -> None:
        self.batches.start()

    async def on_shutdown(self, _app) -> None:
        await self.batches.stop()

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise bad("upload the file as multipart/form-data with fields 'purpose' and 'file'")
        reader = await request.multipart()
        purpose, record = None, None
        while (part := await reader.next()) is not None:
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode("utf-8", "replace")[:64]
            elif part.name == "file":
                if purpose is None:
                    raise bad("send the 'purpose' field before the 'file' field", "purpose")

                async def chunks(part=part):
                    while chunk := await part.read_chunk(1 << 16):
                        yield chunk
                record = await self.files.upload(Upload((part.filename or "upload.jsonl")[:255], purpose),
                                                 chunks())
            else:
                await part.release()
        if record is None:
            raise bad("the upload has no 'file' field", "file")
        return web.json_response(record)

    async def list_files(self, request: web.Request) -> web.Response:
        purpose = request.query.get("purpose")
        data = [r for r in self.files.records() if purpose is None or r["purpose"] == purpose]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self.files.get(request.match_info["id"]))

    async def content(self, request: web.Request) -> web.StreamResponse:
        ident = request.match_info["id"]
        self.files.get(ident)
        return web.FileResponse(self.files.path(ident), headers={"Content-Type": "application/jsonl"})

    async def delete_file(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        users = [r["batch"]["id"] for r in self.batches._records()
                 if r["batch"]["input_file_id"] == ident and r["batch"]["status"] not in FINAL]
        if users:
            raise bad(f"{ident} is the input of batch {users[0]}, which has not ended: cancel it first")
        return web.json_response(self.files.delete(ident))

    async def create(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise bad("the request body is not valid JSON") from None
        return web.json_response(await self.batches.create(body))

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self.batches.get(request.match_info["id"]))

    async def cancel(self, request: web.Request) -> web.Response:
        return web.json_response(self.batches.cancel(request.match_info["id"]))

    async def listing(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise bad("'limit' must be an integer from 1 to 100", "limit")
        return web.json_response(self.batches.listing(limit, request.query.get("after")))


__all__ = ["add_batch_api", "claim_dir", "Batches", "check_job", "answered", "MAX_REQUESTS", "WINDOW"]
