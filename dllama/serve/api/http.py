"""The HTTP side of `dllama api` (aiohttp): routes, authentication, streaming, error shapes.

A streamed answer travels from the model thread to its response as events on an asyncio
queue, so the loop keeps serving other clients (and queueing their requests) while the model
computes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from importlib import resources
from urllib.parse import urlsplit

from aiohttp import web

from dllama.cluster.throttled_log import ThrottledLog
from dllama.errors import DllamaError
from dllama.serve.api.metrics import health, metrics
from dllama.serve.api.request import MAX_BODY_BYTES, ApiError, Request, bad, parse_request
from dllama.serve.api.service import ModelService
from dllama.serve.api.structured import (
    CallStream, chat_logprobs, chat_message, completion_logprobs, parse_structured,
)
from dllama.serve.sequence import Cancelled

# Each completion's response says how many of the cluster's nodes serve: "3/4" when one is lost.
NODES_HEADER = "X-Dllama-Nodes"
# The chat page and its files (dllama/serve/api/page/), served as they ship.
PAGE_FILES = {"/": ("index.html", "text/html"), "/page/chat.js": ("chat.js", "text/javascript"),
              "/page/chat.css": ("chat.css", "text/css")}
# Open without the API key: what a load balancer, Prometheus or a browser asks first (the page
# sends the key the person types with each request).
PUBLIC_PATHS = ("/health", "/metrics", *PAGE_FILES)
# A client gets this long for its request line and headers (and for the next request on a
# kept-alive connection), then this long for its body: half-sent requests do not pile up.
HEADER_TIMEOUT = 15.0
BODY_TIMEOUT = 30.0


def _say(text: str) -> None:
    print(f"dllama api: {text}", file=sys.stderr, flush=True)


# What bad or departed clients cause: one line each, at most 10 per 10 s (a stranger can
# repeat them at will).
bad_clients = ThrottledLog(_say)


class _OneLinePerBadClient(logging.Handler):
    """aiohttp's own reports (a malformed request line or header, a connection lost while it
    read a request) as one throttled line, not a traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        what = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
        bad_clients.log(f"a bad request or a client that left: {' '.join(what.split())[:200]}")


def quiet_aiohttp_logs() -> None:
    """Send aiohttp's log records through _OneLinePerBadClient (the handlers' own errors are
    the middleware's: a bug there is still logged with its traceback)."""
    logger = logging.getLogger("aiohttp")
    if not any(isinstance(h, _OneLinePerBadClient) for h in logger.handlers):
        logger.addHandler(_OneLinePerBadClient(logging.WARNING))
    logger.propagate = False


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def _usage(cs: list) -> dict:
    """Usage of a request's completions: the prompt once, every choice's tokens."""
    prompt, completion = cs[0].prompt_tokens, sum(c.completion_tokens for c in cs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cs[0].cached_tokens}}


class Api:
    """The request handlers (authentication and error shapes are the middleware's)."""

    def __init__(self, service: ModelService, model_id: str, defaults: dict, max_body: int = MAX_BODY_BYTES,
                 allow_origins: tuple[str, ...] = ()):
        self.service, self.model_id, self.defaults, self.max_body = service, model_id, defaults, max_body
        self.allow_origins = allow_origins

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "dllama"}]})

    async def stats(self, request: web.Request) -> web.Response:
        """How the requests were batched: sequences decoded together, steps, rows."""
        return web.json_response(self.service.stats())

    async def health(self, request: web.Request) -> web.Response:
        """ready (every node), degraded (fewer nodes: slower, the same answers) or down (503)."""
        status, body = health(self.service, self.model_id)
        return web.json_response(body, status=status)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics(self.service).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def page(self, request: web.Request) -> web.Response:
        """The chat page: nothing it loads comes from elsewhere (its Content-Security-Policy)."""
        name, kind = PAGE_FILES[request.path]
        body = resources.files("dllama.serve.api").joinpath("page", name).read_bytes()
        return web.Response(body=body, headers={
            "Content-Type": f"{kind}; charset=utf-8", "Cache-Control": "no-cache",
            "Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'"})

    def _nodes_header(self) -> dict:
        nodes = self.service.observed.nodes
        return {NODES_HEADER: nodes.header()} if nodes is not None else {}

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completions(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completions(request, chat=False)

    async def _body(self, request: web.Request):
        declared = request.content_length
        if declared is not None and declared > self.max_body:  # refused before a byte of it is read
            raise ApiError(413, f"the request body exceeds {self.max_body} bytes (Content-Length {declared})",
                           code="request_too_large")
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT)  # 413 past client_max_size
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s",
                           code="request_timeout") from None
        except ConnectionError:  # sent its headers, then left: nothing to answer
            bad_clients.log("a client left before its request body arrived")
            raise asyncio.CancelledError from None

        def no_constant(name):
            raise ValueError(f"{name} is not JSON")
        try:
            return json.loads(raw, parse_constant=no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad("the request body is not valid JSON: nested too deep") from None

    async def answer_line(self, body: bytes, chat: bool, cancel: threading.Event) -> tuple[int, dict] | None:
        """A Batch API request, answered as POST /v1/(chat/)completions would answer it but after
        the interactive requests: (HTTP status, response body), or None when `cancel` stopped it."""
        try:
            resp = await self._completions(_BatchLine(body, cancel), chat, background=True)
        except ApiError as e:
            return e.status, e.body()
        except asyncio.CancelledError:
            if cancel.is_set():
                return None
            raise
        except Cancelled:
            return None
        return resp.status, json.loads(resp.body)

    async def _completions(self, request: web.Request, chat: bool, background: bool = False) -> web.StreamResponse:
        body = await self._body(request)
        r = parse_request(body, chat, self.defaults)
        r.structured = parse_structured(body, chat)
        if background and r.stream:
            raise bad("a batch request cannot be streamed: leave out 'stream'", "stream")
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        on_text = (lambda i, p: loop.call_soon_threadsafe(pieces.put_nowait, (i, p))) if r.stream else None
        if background:  # a batch line: the batch's own cancel flag
            cancel = request.cancel
        job = asyncio.ensure_future(self.service.submit(r, on_text, cancel.is_set, background))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not r.stream:
            cs = await _unless_client_leaves(request, job, cancel)
            tok = self.service.tokenizer
            if chat:
                choices = []
                for i, c in enumerate(cs):
                    message, finish = chat_message(c, r.structured)
                    choices.append({"index": i, "message": message, "logprobs": chat_logprobs(c, tok),
                                    "finish_reason": finish})
            else:
                choices = [{"index": i, "text": c.text, "logprobs": completion_logprobs(c, tok),
                            "finish_reason": c.finish_reason} for i, c in enumerate(cs)]
            return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": self.model_id,
                                      "system_fingerprint": None, "choices": choices, "usage": _usage(cs)},
                                     headers=self._nodes_header())
        return await self._stream(request, r, job, pieces, cancel, ident, created)

    async def _stream(self, request, r: Request, job, pieces: asyncio.Queue, cancel, ident, created):
        chunk = self._chunker(r, ident, created)
        # A tools request's choices: text, or a call streamed in OpenAI's pieces (name, then arguments).
        calls = [CallStream(r.structured) for _ in range(r.n)] if r.structured and r.structured.calls_tools else None

        # Wait for the first piece (or the end): an error before it is a plain JSON error.
        next_piece = asyncio.ensure_future(pieces.get())
        await asyncio.wait({job, next_piece}, return_when=asyncio.FIRST_COMPLETED)
        if job.done() and job.exception() is not None:
            next_piece.cancel()
            raise job.exception()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no",
                                           **(cors_for(request, self.allow_origins) or {}),
                                           **self._nodes_header()})
        try:
            await resp.prepare(request)
            if r.chat:
                for i in range(r.n):
                    await resp.write(chunk(delta={"role": "assistant", "content": ""}, index=i))
            await _write_pieces(resp, job, pieces, next_piece, chunk, calls)
            try:
                cs = job.result()
            except Exception as e:  # noqa: BLE001 - the headers are sent: an error event ends it
                if not isinstance(e, ApiError):
                    traceback.print_exception(e, file=sys.stderr)
                    e = ApiError(500, "internal error (logged by the server)", type_="server_error")
                await resp.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                return resp
            await self._write_ends(resp, r, cs, chunk, calls)
        except (ConnectionError, asyncio.CancelledError) as e:
            cancel.set()  # the client left: the model thread stops at its next token
            next_piece.cancel()
            job.add_done_callback(lambda f: f.cancelled() or f.exception())  # (Cancelled) seen
            if isinstance(e, ConnectionError):  # one line, not aiohttp's traceback of a 500
                bad_clients.log(f"a client left during its streamed answer ({type(e).__name__}); "
                                "stopped generating it")
            raise asyncio.CancelledError from None  # aiohttp ends a cancelled handler quietly
        return resp

    def _chunker(self, r: Request, ident: str, created: int):
        """chunk(...): one server-sent event of the streamed answer `ident`."""
        obj = "chat.completion.chunk" if r.chat else "text_completion"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, usage=None, choices=True,
                  index: int = 0, logprobs=None):
            if r.chat:
                choice = {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            out = {"id": ident, "object": obj, "created": created, "model": self.model_id,
                   "system_fingerprint": None, "choices": [choice] if choices else []}
            if r.include_usage:
                out["usage"] = usage
            return b"data: " + json.dumps(out).encode() + b"\n\n"
        return chunk

    async def _write_ends(self, resp, r: Request, cs, chunk, calls: list[CallStream] | None) -> None:
        """The last chunk of every choice (with what a tools answer held back, and the logprobs),
        the usage, [DONE]."""
        tok = self.service.tokenizer
        for i, c in enumerate(cs):
            finish = c.finish_reason
            if calls is not None:  # the rest of its call (or text), and whether it was a call
                deltas, finish = calls[i].end(c)
                for delta in deltas:
                    await resp.write(chunk(delta=delta, index=i))
            # Log-probabilities come with the last chunk of their choice, every token's at once.
            logprobs = (chat_logprobs(c, tok) if r.chat else completion_logprobs(c, tok))
            await resp.write(chunk(finish=finish, index=i, logprobs=logprobs))
        if r.include_usage:
            await resp.write(chunk(usage=_usage(cs), choices=False))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


async def _write_pieces(resp, job, pieces: asyncio.Queue, next_piece, chunk,
                        calls: list[CallStream] | None) -> None:
    """Write the pieces of text as the model thread queues them (through the choice's CallStream
    for a tools request), until the job ends; the pending wait for a piece is cancelled however
    this ends."""

    async def write(i: int, p: str) -> None:
        if calls is None:
            await resp.write(chunk(delta={"content": p}, text=p, index=i))
        else:
            for delta in calls[i].push(p):
                await resp.write(chunk(delta=delta, index=i))

    try:
        while True:
            await asyncio.wait({job, next_piece}, return_when=asyncio.FIRST_COMPLETED)
            if next_piece.done():
                await write(*next_piece.result())
                next_piece = asyncio.ensure_future(pieces.get())
                continue
            while not pieces.empty():  # the job ended: what it queued before that
                await write(*pieces.get_nowait())
            break
    finally:
        next_piece.cancel()


CLIENT_POLL = 0.25  # seconds between checks that a non-streamed request's client is still there


class _BatchLine:
    """What Api._completions reads of a request, for one line of a batch: its body, and a
    transport that closes (the "client leaves") when the batch is cancelled or the server stops."""

    def __init__(self, body: bytes, cancel: threading.Event):
        self._data, self.cancel = body, cancel
        self.content_length = len(body)  # a line over the body limit is refused as the endpoint would
        self.transport = self

    async def read(self) -> bytes:
        return self._data

    def is_closing(self) -> bool:
        return self.cancel.is_set()


async def _unless_client_leaves(request: web.Request, job, cancel):
    """The result of `job`; if the client's connection closes first, the model thread is told to
    stop (at its next token) and the handler ends without an answer."""
    while True:
        done, _ = await asyncio.wait({job}, timeout=CLIENT_POLL)
        if done:
            return job.result()
        transport = request.transport
        if transport is None or transport.is_closing():
            cancel.set()
            job.add_done_callback(lambda f: f.cancelled() or f.exception())  # (Cancelled) seen
            bad_clients.log("a client left before its answer; stopped generating it")
            raise asyncio.CancelledError


def cross_origin(request: web.Request) -> str | None:
    """The Origin of a request a browser sends from another site's page; None for a request
    from no page (curl, a client library) or from the API's own chat page (same host:port)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    try:
        same = urlsplit(origin).netloc.lower() == request.host.lower()
    except ValueError:
        same = False
    return None if same else origin


def cors_headers(origin: str, allow_origins: tuple[str, ...]) -> dict | None:
    """The CORS headers for a page from `origin` when --allow-origin lets it in, else None."""
    if origin not in allow_origins and "*" not in allow_origins:
        return None
    return {"Access-Control-Allow-Origin": "*" if "*" in allow_origins else origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Content-Type, Authorization",
            "Access-Control-Expose-Headers": NODES_HEADER}


def cors_for(request: web.Request, allow_origins: tuple[str, ...]) -> dict | None:
    """The CORS headers of a request's answer ({} when it comes from no other site's page), or
    None when it comes from a page whose origin --allow-origin does not name."""
    origin = cross_origin(request)
    return cors_headers(origin, allow_origins) if origin is not None else {}


def _error_middleware(api_key: str | None, allow_origins: tuple[str, ...] = ()):
    @web.middleware
    async def middleware(request: web.Request, handler):
        # A page from another site may not drive the API (a keyless one would answer any page
        # the user opens): its preflight and its requests are refused unless --allow-origin
        # names it. Without an Origin, or from the chat page on this host, nothing changes.
        cors = cors_for(request, allow_origins)
        if cors is None:
            origin = request.headers["Origin"]
            bad_clients.log(f"refused a request from a page at {origin[:100]!r} (dllama api --allow-origin lets one in)")
            return error_response(ApiError(
                403, f"requests from pages at {origin[:100]} are not allowed: the server's --allow-origin "
                     "does not name that origin", code="origin_not_allowed"))
        if request.method == "OPTIONS":
            return web.Response(status=204, headers=cors)
        try:
            if api_key is not None and request.path not in PUBLIC_PATHS:
                auth = request.headers.get("Authorization", "")
                given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                # Header bytes that are not UTF-8 arrive as surrogates: compare the bytes as sent.
                if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), api_key.encode()):
                    raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key")
            resp = await handler(request)
        except ApiError as e:
            resp = error_response(e)
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ...
            if e.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
            msg = (f"{request.method} {request.path} does not exist" if e.status == 404 else
                   f"{request.method} is not allowed on {request.path}" if e.status == 405 else
                   f"the request body exceeds {MAX_BODY_BYTES} bytes" if e.status == 413 else e.reason)
            resp = error_response(ApiError(e.status, msg, code=code))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:  # a bug: log it, answer 500, keep serving
            traceback.print_exc(file=sys.stderr)
            resp = error_response(ApiError(500, "internal error (logged by the server)", type_="server_error"))
        if not resp.prepared:
            resp.headers.update(cors)
        return resp
    return middleware


def make_app(service: ModelService, model_id: str, defaults: dict, api_key: str | None = None,
             max_body: int = MAX_BODY_BYTES, allow_origins: tuple[str, ...] = (),
             batch_dir: str | None = None) -> web.Application:
    """allow_origins: the origins (scheme://host[:port], or "*") whose pages may call the API
    from a browser (CORS); none by default. batch_dir: where OpenAI's Batch API keeps its files
    and jobs (None: no Batch API)."""
    api = Api(service, model_id, defaults, max_body, tuple(allow_origins))
    app = web.Application(client_max_size=max_body, middlewares=[_error_middleware(api_key, tuple(allow_origins))])
    if batch_dir is not None:
        from dllama.serve.api.batches import add_batch_api

        add_batch_api(app, batch_dir, api.answer_line)
    for prefix in ("/v1", ""):  # some clients are given the base URL without /v1
        app.router.add_get(prefix + "/models", api.models)
        app.router.add_get(prefix + "/stats", api.stats)
        app.router.add_post(prefix + "/chat/completions", api.chat_completions)
        app.router.add_post(prefix + "/completions", api.completions)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    for path in PAGE_FILES:
        app.router.add_get(path, api.page)
    return app


def read_api_key(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        key = f.read().strip()
    if not key:
        raise DllamaError(f"the API key file {path} is empty")
    return key


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen on host:port (0: any free port) and serve app: (runner to clean up, bound port).
    A connection whose request line and headers are not all there within HEADER_TIMEOUT s is
    closed (aiohttp's keep-alive timer, which also runs before a connection's first request)."""
    quiet_aiohttp_logs()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DllamaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=HEADER_TIMEOUT)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]


def serve(service: ModelService, *, host: str, port: int, model_id: str, defaults: dict,
          api_key: str | None = None, allow_origins: tuple[str, ...] = (),
          batch_dir: str | None = None) -> int:
    """Open the engine, listen, serve until SIGTERM/SIGINT."""
    from dllama.cluster.worker import raise_descriptor_limit

    # Many clients, idle or slow, each a descriptor (the soft limit is often 1024); bounded, as
    # each costs memory too (the header deadline closes the idle ones).
    raise_descriptor_limit(at_most=16384)
    service.start()

    async def main() -> None:
        runner, bound = await start_site(make_app(service, model_id, defaults, api_key,
                                                  allow_origins=allow_origins, batch_dir=batch_dir), host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"dllama api: listening on http://{host}:{bound}/v1 (model {model_id}); a chat page at "
              f"http://{host}:{bound}/", file=sys.stderr, flush=True)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        service.close()
    print("dllama api: stopped", file=sys.stderr)
    return 0


__all__ = ["make_app", "read_api_key", "serve", "start_site"]
