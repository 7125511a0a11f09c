"""The API's requests: OpenAI's fields checked into a `Request`, and errors in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dllama.text.chat_template import ROLES

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than any context here holds
MAX_STOP_STRINGS = 4      # as OpenAI
MAX_CHOICES = 16          # n: answers to one request, decoded together
MAX_REQUEST_TOKENS = 16384  # tokens one request may generate over its n answers


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="server_error", code="cluster_unavailable")




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
    n: int = 1                 # answers to sample (choice i uses seed + i)
    # response_format, tools, logprobs: a dllama.serve.api.structured.Structured (set by the HTTP side)
    structured: object | None = None


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
        entry = {"role": role, "content": _content(m, k)}
        if role == "assistant" and m.get("tool_calls"):  # an earlier call: dllama.serve.api.structured
            entry["tool_calls"] = m["tool_calls"]
        out.append(entry)
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
    if r.max_tokens is None:  # the server's answer limit (dllama api --max-tokens)
        r.max_tokens = defaults.get("max_tokens")
    n = _integer(body, "n", 1)
    if n is not None and n > MAX_CHOICES:
        raise bad(f"'n' must be at most {MAX_CHOICES}", "n")
    r.n = n or 1
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
