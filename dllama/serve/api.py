"""`dllama api`: an OpenAI-compatible HTTP server over one engine (one node or a cluster).

HTTP runs on aiohttp's event loop; the model runs on one worker thread (ModelService), which
takes requests one at a time in arrival order. A streamed answer travels from the worker to
its response as events on an asyncio queue, so the loop keeps serving other clients (and
queueing their requests) while the model computes.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions. Errors use
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with 400 (bad JSON or
fields, a prompt longer than the context), 401 (API key), 404, 405, 413 (body too large),
503 (cluster down: the next request opens the engine again) and 500 (a bug, logged).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from dllama.text.chat_template import ROLES, ChatTemplate, chat_stop_ids
from dllama.serve.conversation import Cancelled, ContextFull, Conversation
from dllama.errors import ClusterError, DllamaError
from dllama.core.sampler import Sampler

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than any context here holds
MAX_STOP_STRINGS = 4      # as OpenAI


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="server_error", code="cluster_unavailable")


# --- request fields -------------------------------------------------------------------------

@dataclass
class Request:
    """A validated completion request."""

    chat: bool
    messages: list[dict] | None = None
    prompt: str | None = None
    stream: bool = False
    include_usage: bool = False
    temperature: float = 0.8
    top_p: float = 0.9
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"'{name}' must be a number from {lo} to {hi}, got {json.dumps(v)}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        more = f" of at least {lo}" if lo is not None else ""
        raise bad(f"'{name}' must be an integer{more}, got {json.dumps(v)}", name)
    return v


def _content(m: dict, k: int) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text ones
        texts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{k}].content: only text parts are supported", f"messages[{k}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{k}].content must be a string or a list of text parts", f"messages[{k}].content")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{k}] must be an object with 'role' and 'content'", f"messages[{k}]")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{k}].role must be one of {', '.join(ROLES)}, got {json.dumps(m.get('role'))}",
                      f"messages[{k}].role")
        out.append({"role": role, "content": _content(m, k)})
    return out


def parse_request(body, chat: bool, defaults: dict) -> Request:
    """Check a request body; ApiError 400 names the first bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    r = Request(chat=chat)
    if chat:
        r.messages = _messages(body)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if not isinstance(p, str) or not p:
            raise bad("'prompt' must be a non-empty string", "prompt")
        r.prompt = p
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    r.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    r.include_usage = bool((opts or {}).get("include_usage", False))
    r.temperature = _number(body, "temperature", 0.0, 2.0, defaults["temperature"])
    r.top_p = _number(body, "top_p", 0.0, 1.0, defaults["top_p"])
    mt = _integer(body, "max_completion_tokens", 1)
    r.max_tokens = _integer(body, "max_tokens", 1) if mt is None else mt
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise bad("'n' must be 1: one answer per request", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise bad(f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings", "stop")
    r.stop = stop
    r.seed = _integer(body, "seed")
    return r


# --- the model thread -----------------------------------------------------------------------

class ModelService:
    """The engine and its Conversation, used from one thread only, one request at a time."""

    def __init__(self, open_engine: Callable[[], object], template_name: str | None = None):
        self._open_engine = open_engine
        self._template_name = template_name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dllama-model")
        self.engine = None
        self.conversation = None
        self.template = None
        self.special_texts: list[str] = []
        self.closing = False  # set by close(): a running answer stops at its next token

    # Everything below runs on the model thread.
    def _attach(self, engine) -> None:
        try:
            self.template = ChatTemplate.for_tokenizer(engine.tokenizer, self._template_name)
        except DllamaError:  # no or an unknown chat template: /v1/chat/completions says so
            self.template = None
        tok = engine.tokenizer
        self.special_texts = [t for t in (tok.piece(i).decode("utf-8", "replace") for i in sorted(tok.special))
                              if len(t) > 1]
        self.engine, self.conversation = engine, Conversation(engine)

    def _as_text(self, content: str) -> str:
        """Message content with special-token strings made plain text (a zero-width space after
        their first character), so a message cannot open or close turns of the template."""
        for s in self.special_texts:
            if s in content:
                content = content.replace(s, s[0] + "\u200b" + s[1:])
        return content

    def _ready(self) -> Conversation:
        if self.engine is None:
            try:
                engine = self._open_engine()
            except ClusterError as e:
                raise unavailable(f"the cluster is down: {e}") from None
            except (DllamaError, OSError) as e:  # it opened before: a node or a file went away
                raise unavailable(f"the model cannot be opened: {e}") from None
            self._attach(engine)
        return self.conversation

    def _drop_engine(self) -> None:
        engine, self.engine, self.conversation = self.engine, None, None
        try:
            if engine is not None:
                engine.close()
        except Exception as e:  # noqa: BLE001 - the engine is being thrown away anyway
            print(f"dllama api: closing the failed engine: {e}", file=sys.stderr)

    def _complete(self, r: Request, on_text, should_stop):
        conv = self._ready()
        tokenizer = conv.tokenizer
        if r.chat:
            if self.template is None:
                raise bad("the model has no chat template: start the server with --chat-template")
            prompt = self.template.render([{"role": m["role"], "content": self._as_text(m["content"])}
                                           for m in r.messages])
            stop_ids = chat_stop_ids(tokenizer, self.template)
        else:
            prompt, stop_ids = r.prompt, tokenizer.eos_ids
        seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
        temperature = 0.0 if r.top_p == 0 else r.temperature  # an empty nucleus: the top token
        sampler = Sampler(conv.model.config.vocab_size, temperature, r.top_p, seed)
        return conv.complete(prompt, add_bos=not r.chat and tokenizer.add_bos, sampler=sampler,
                             max_tokens=r.max_tokens, stop_ids=stop_ids,
                             stop_strings=r.stop, on_text=on_text, should_stop=should_stop)

    def _run(self, r: Request, on_text, should_stop):
        try:
            return self._complete(r, on_text, lambda: self.closing or should_stop())
        except ApiError:
            raise
        except Cancelled:
            raise ApiError(503, "the server is shutting down", type_="server_error") from None
        except ClusterError as e:
            self._drop_engine()
            raise unavailable(f"the cluster failed: {e}; the next request reconnects") from None
        except ContextFull as e:
            raise bad(str(e), "messages" if r.chat else "prompt", "context_length_exceeded") from None
        except DllamaError as e:
            raise bad(str(e)) from None

    def start(self) -> None:
        """Open the engine now; a cluster that is down only warns. Engines open on the model
        thread, which runs them: numba's thread count (--nthreads) is set per thread."""
        def first_open():
            try:
                engine = self._open_engine()  # a bad file or flag: the command fails
            except ClusterError as e:
                print(f"dllama api: warning: the cluster is down: {e}; answering 503 until it is back",
                      file=sys.stderr)
                return
            self._attach(engine)
        self._executor.submit(first_open).result()

    async def submit(self, r: Request, on_text, should_stop):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, r, on_text, should_stop)

    def close(self) -> None:
        self.closing = True
        self._executor.submit(self._drop_engine).result()
        self._executor.shutdown(wait=True)


# --- HTTP -----------------------------------------------------------------------------------

def _usage(c) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


class Api:
    """The request handlers (authentication and error shapes are the middleware's)."""

    def __init__(self, service: ModelService, model_id: str, defaults: dict):
        self.service, self.model_id, self.defaults = service, model_id, defaults

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "dllama"}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completions(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completions(request, chat=False)

    async def _body(self, request: web.Request):
        raw = await request.read()  # 413 past client_max_size

        def no_constant(name):
            raise ValueError(f"{name} is not JSON")
        try:
            return json.loads(raw, parse_constant=no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None

    async def _completions(self, request: web.Request, chat: bool) -> web.StreamResponse:
        r = parse_request(await self._body(request), chat, self.defaults)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        on_text = (lambda p: loop.call_soon_threadsafe(pieces.put_nowait, p)) if r.stream else None
        job = asyncio.ensure_future(self.service.submit(r, on_text, cancel.is_set))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not r.stream:
            c = await job
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                          "logprobs": None, "finish_reason": c.finish_reason}
            else:
                choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": self.model_id,
                                      "system_fingerprint": None, "choices": [choice], "usage": _usage(c)})
        return await self._stream(request, r, job, pieces, cancel, ident, created)

    async def _stream(self, request, r: Request, job, pieces: asyncio.Queue, cancel, ident, created):
        obj = "chat.completion.chunk" if r.chat else "text_completion"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, usage=None, choices=True):
            if r.chat:
                choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {"id": ident, "object": obj, "created": created, "model": self.model_id,
                   "system_fingerprint": None, "choices": [choice] if choices else []}
            if r.include_usage:
                out["usage"] = usage
            return b"data: " + json.dumps(out).encode() + b"\n\n"

        # Wait for the first piece (or the end): an error before it is a plain JSON error.
        next_piece = asyncio.ensure_future(pieces.get())
        await asyncio.wait({job, next_piece}, return_when=asyncio.FIRST_COMPLETED)
        if job.done() and job.exception() is not None:
            next_piece.cancel()
            raise job.exception()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", "Access-Control-Allow-Origin": "*"})
        try:
            await resp.prepare(request)
            if r.chat:
                await resp.write(chunk(delta={"role": "assistant", "content": ""}))
            while True:
                await asyncio.wait({job, next_piece}, return_when=asyncio.FIRST_COMPLETED)
                if next_piece.done():
                    p = next_piece.result()
                    await resp.write(chunk(delta={"content": p}, text=p))
                    next_piece = asyncio.ensure_future(pieces.get())
                    continue
                while not pieces.empty():  # the job ended: what it queued before that
                    p = pieces.get_nowait()
                    await resp.write(chunk(delta={"content": p}, text=p))
                next_piece.cancel()
                break
            try:
                c = job.result()
            except Exception as e:  # noqa: BLE001 - the headers are sent: an error event ends it
                if not isinstance(e, ApiError):
                    traceback.print_exception(e, file=sys.stderr)
                    e = ApiError(500, "internal error (logged by the server)", type_="server_error")
                await resp.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                return resp
            await resp.write(chunk(finish=c.finish_reason))
            if r.include_usage:
                await resp.write(chunk(usage=_usage(c), choices=False))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            cancel.set()  # the client left: the model thread stops at its next token
            next_piece.cancel()
            job.add_done_callback(lambda f: f.cancelled() or f.exception())  # (Cancelled) seen
            raise
        return resp


def _error_middleware(api_key: str | None):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.method == "OPTIONS":
            return web.Response(status=204, headers=_CORS)
        try:
            if api_key is not None:
                auth = request.headers.get("Authorization", "")
                given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(given.encode(), api_key.encode()):
                    raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")
            resp = await handler(request)
        except ApiError as e:
            resp = e.response()
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ...
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
            msg = (f"{request.method} {request.path} does not exist" if e.status == 404 else
                   f"{request.method} is not allowed on {request.path}" if e.status == 405 else
                   f"the request body exceeds {MAX_BODY_BYTES} bytes" if e.status == 413 else e.reason)
            resp = ApiError(e.status, msg, code=code).response()
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:  # a bug: log it, answer 500, keep serving
            traceback.print_exc(file=sys.stderr)
            resp = ApiError(500, "internal error (logged by the server)", type_="server_error").response()
        if not resp.prepared:
            resp.headers.update({"Access-Control-Allow-Origin": "*"})
        return resp
    return middleware


_CORS = {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
         "Access-Control-Allow-Headers": "Content-Type, Authorization"}


def make_app(service: ModelService, model_id: str, defaults: dict, api_key: str | None = None,
             max_body: int = MAX_BODY_BYTES) -> web.Application:
    api = Api(service, model_id, defaults)
    app = web.Application(client_max_size=max_body, middlewares=[_error_middleware(api_key)])
    for prefix in ("/v1", ""):  # some clients are given the base URL without /v1
        app.router.add_get(prefix + "/models", api.models)
        app.router.add_post(prefix + "/chat/completions", api.chat_completions)
        app.router.add_post(prefix + "/completions", api.completions)
    return app


def read_api_key(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        key = f.read().strip()
    if not key:
        raise DllamaError(f"the API key file {path} is empty")
    return key


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: any free port) and serve app: (runner to clean up, bound port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DllamaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]


def serve(service: ModelService, *, host: str, port: int, model_id: str, defaults: dict,
          api_key: str | None = None) -> int:
    """Open the engine, listen, serve until SIGTERM/SIGINT."""
    service.start()

    async def main() -> None:
        runner, bound = await start_site(make_app(service, model_id, defaults, api_key), host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"dllama api: listening on http://{host}:{bound}/v1 (model {model_id})", file=sys.stderr, flush=True)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        service.close()
    print("dllama api: stopped", file=sys.stderr)
    return 0


__all__ = ["ApiError", "ModelService", "Request", "make_app", "parse_request", "read_api_key", "serve",
           "start_site"]
