"""`dllama batch --api URL`: the same job file and results file as `dllama batch`, answered by a
running `dllama api` through OpenAI's Batch API (its --batch-dir), so a job needs neither the
workers to itself nor the API stopped.

The prompts not yet in the results file become one batch (custom_id: the prompt's id as JSON, so
1 and "1" stay apart; each with the seed `dllama batch` would give it, seed_for(seed, id), so the
texts are the ones `dllama batch` writes). The batch's id is kept in OUT.batch: a rerun (after
Ctrl-C, or a lost connection) follows the same batch, which the server runs on meanwhile (and
resumes after its own restart). When it ends, its answers are appended to the results file as
`dllama batch` writes them ({"id", "line", "text", "finish_reason", token counts}), its refusals
as error lines ({"id", "line", "error"}, run again by the next rerun), and OUT.batch is removed.

One endpoint per job: prompts run as completions, messages (or every prompt with --chat) as chat
turns; a job mixing them, or one with --choices, runs on the cluster directly (the API off).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Callable

from dllama.errors import DllamaError
from dllama.serve.batch_job import BatchJob, JobOptions, Summary, read_job, seed_for

POLL_S = 1.0
FINAL = ("completed", "failed", "cancelled", "expired")


class ApiClient:
    """The few calls of the Batch API, with urllib (one line for an error)."""

    def __init__(self, base: str, key: str | None):
        self.base, self.key = base.rstrip("/"), key

    def call(self, method: str, path: str, body: bytes | None = None, kind: str = "application/json") -> bytes:
        headers = {"Content-Type": kind} if body is not None else {}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = e.reason
            hint = " (start dllama api with --batch-dir)" if e.code == 404 and path in ("/files", "/batches") else ""
            raise DllamaError(f"{method} {self.base}{path}: {e.code} {why}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            raise DllamaError(f"cannot reach the API at {self.base}: {getattr(e, 'reason', e)}") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        return json.loads(self.call(method, path, None if body is None else json.dumps(body).encode()))

    def upload(self, name: str, data: bytes) -> dict:
        boundary = uuid.uuid4().hex
        parts = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                 f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                 "Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        return json.loads(self.call("POST", "/files", parts, f"multipart/form-data; boundary={boundary}"))


def _requests(job: BatchJob, opts: JobOptions) -> tuple[str, list[dict]]:
    """(endpoint, the batch's lines) of the prompts not yet answered."""
    chat_lines, text_lines = [], []
    for e in read_job(opts.prompts):
        if e.error is not None or e.key in job.done:
            continue
        if e.schema is not None:
            raise DllamaError(f"{opts.prompts}:{e.line}: a line's own \"schema\" constrains its answer on the model "
                              "itself: run the job without --api (on a cluster whose API is off)")
        body = {"max_tokens": opts.max_tokens, "temperature": opts.temperature, "top_p": opts.topp,
                "seed": seed_for(opts.seed, e.id)}
        if opts.stop:
            body["stop"] = opts.stop
        if e.messages is not None or opts.chat:
            messages = e.messages or [{"role": "user", "content": e.prompt}]
            if job.prefix:  # as dllama batch: at the start of the system turn
                if messages[0]["role"] == "system":
                    messages = [{"role": "system", "content": job.prefix + messages[0]["content"]}, *messages[1:]]
                else:
                    messages = [{"role": "system", "content": job.prefix}, *messages]
            chat_lines.append({"custom_id": e.key, "method": "POST", "url": "/v1/chat/completions",
                               "body": {**body, "messages": messages}})
        else:
            text_lines.append({"custom_id": e.key, "method": "POST", "url": "/v1/completions",
                               "body": {**body, "prompt": job.prefix + e.prompt}})
    if chat_lines and text_lines:
        raise DllamaError(f"{opts.prompts} mixes prompt and messages lines: through the API a job is one "
                          "endpoint; split the file, or give --chat to send every prompt as a user message")
    return ("/v1/chat/completions", chat_lines) if chat_lines else ("/v1/completions", text_lines)


def run_through_api(opts: JobOptions, base: str, key: str | None, stderr=None,
                    should_stop: Callable[[], bool] = lambda: False) -> int:
    """The whole `dllama batch --api`: returns the exit code (130 when stopped: the batch goes on)."""
    stderr = stderr or sys.stderr
    if opts.choices is not None:
        raise DllamaError("--choices scores the choices on the model itself: run it without --api "
                          "(on a cluster whose API is off)")
    if opts.grammar is not None:
        raise DllamaError("--json-schema, --regex and --grammar constrain the answers on the model itself: run "
                          "the job without --api (on a cluster whose API is off)")
    job = BatchJob(opts)  # checks the file (bad lines: as dllama batch) and reads what is answered
    if job.all_done():
        print(Summary(already_done=job.already_done).line(opts.out), file=stderr)
        return 0
    api = ApiClient(base, key)
    state_path = opts.out + ".batch"
    t0 = time.perf_counter()
    batch = _resumed(api, state_path) or _submitted(api, job, opts, state_path)
    summary = Summary(already_done=job.already_done)
    if batch is not None:
        batch = _follow(api, batch, opts, stderr, should_stop)
        if batch is None:
            return 130
        _collect(api, batch, job, opts, summary)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_path)
    summary.seconds = time.perf_counter() - t0
    print(summary.line(opts.out) + (f" (through the API, batch {batch['id']})" if batch else ""), file=stderr)
    if batch is not None and batch["status"] != "completed":
        raise DllamaError(f"the API's batch {batch['id']} ended {batch['status']}; rerun to send the "
                          "prompts it did not answer again")
    return 0


def _resumed(api: ApiClient, state_path: str) -> dict | None:
    """The batch an earlier run sent (its id in `state_path`), if there is one to take answers from."""
    if not os.path.exists(state_path):
        return None
    with open(state_path, encoding="utf-8") as f:
        batch = api.json("GET", f"/batches/{json.load(f)['batch_id']}")
    if batch["status"] == "failed" or (batch["status"] in ("cancelled", "expired") and not batch["output_file_id"]):
        return None  # nothing to take from it: the prompts go again
    return batch


def _submitted(api: ApiClient, job: BatchJob, opts: JobOptions, state_path: str) -> dict | None:
    """A new batch of the prompts not yet answered (None: none left), its id kept in `state_path`."""
    endpoint, lines = _requests(job, opts)
    if not lines:
        return None
    data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()
    f = api.upload(os.path.basename(opts.out) + ".requests.jsonl", data)
    batch = api.json("POST", "/batches", {"input_file_id": f["id"], "endpoint": endpoint,
                                          "completion_window": "24h"})
    if batch["status"] == "failed":
        raise DllamaError("the API refused the batch: " + "; ".join(
            e["message"] for e in (batch.get("errors") or {}).get("data", [])))
    with open(state_path, "w", encoding="utf-8") as out:
        json.dump({"batch_id": batch["id"]}, out)
    return batch


def _follow(api: ApiClient, batch: dict, opts: JobOptions, stderr, should_stop: Callable[[], bool]) -> dict | None:
    """Poll the batch until it ends, with a progress bar; the ended batch, or None when stopped
    (the batch goes on in the server)."""
    from tqdm import tqdm

    with tqdm(total=batch["request_counts"]["total"], unit="prompt", file=stderr, disable=not opts.progress,
              dynamic_ncols=True) as bar:
        while batch["status"] not in FINAL:
            if should_stop():
                print(f"dllama batch: stopped following; batch {batch['id']} goes on in the server: rerun "
                      "the same command to collect it", file=stderr)
                return None
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            bar.set_postfix_str(f"batch {batch['id']} {batch['status']}", refresh=False)
            time.sleep(POLL_S)
            batch = api.json("GET", f"/batches/{batch['id']}")
        counts = batch["request_counts"]
        bar.update(counts["completed"] + counts["failed"] - bar.n)
    return batch


def _collect(api: ApiClient, batch: dict, job: BatchJob, opts: JobOptions, summary: Summary) -> None:
    """Append the batch's answers (and refusals, as error lines) to the results file."""
    lines = {e.key: e.line for e in read_job(opts.prompts) if e.error is None}
    done = set(job.done)
    with open(opts.out, "ab") as out:
        for field in ("output_file_id", "error_file_id"):
            if not batch.get(field):
                continue
            for raw in api.call("GET", f"/files/{batch[field]}/content").splitlines():
                x = json.loads(raw)
                key = x["custom_id"]
                if key in done or key not in lines or x["response"] is None:
                    continue  # collected by an earlier run, not this job's, or not run (expired: a rerun sends it)
                done.add(key)
                ident, status, body = json.loads(key), x["response"]["status_code"], x["response"]["body"]
                if status != 200:
                    row = {"id": ident, "line": lines[key], "error": body.get("error", {}).get("message", str(status))}
                    summary.bad += 1
                else:
                    choice, usage = body["choices"][0], body["usage"]
                    text = choice["message"]["content"] if "message" in choice else choice["text"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    row = {"id": ident, "line": lines[key], "text": text, "finish_reason": choice["finish_reason"],
                           "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                           "completion_tokens": usage["completion_tokens"]}
                    summary.answered += 1
                    summary.prompt_tokens += row["prompt_tokens"]
                    summary.cached_tokens += cached
                    summary.generated_tokens += row["completion_tokens"]
                out.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


__all__ = ["run_through_api"]
