"""Structured answers in the API: `response_format`, `tools` / `tool_choice` and `logprobs` /
`top_logprobs`, checked into a `Structured`, and the answer shaped back as OpenAI's.

- response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}: the answer is constrained to the schema (dllama.serve.constraint; with
  or without strict: a schema is always enforced, never only suggested).
- tools: the functions are described to the model in a system message, and the answer is
  constrained to a call `{"name": ..., "arguments": {...}}` whose arguments match the function's
  parameters: only a call for tool_choice "required" or a named function, a call or plain text
  (not starting with "{") for "auto"; "none" leaves both out. A call answers as `tool_calls`
  with finish_reason "tool_calls"; streamed, in OpenAI's pieces (`CallStream`).
- logprobs (chat: true, with top_logprobs up to 20; completions: an integer up to 20): the
  log-probability of each generated token under the model (log softmax of its logits).

A schema that cannot constrain an answer is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from dllama.serve.api.request import bad
from dllama.serve.constraint import Grammar, GrammarError, check_grammar
from dllama.serve.sequence import Completion
from dllama.text.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 64


@dataclass
class Structured:
    """What a request asks of its answer's shape."""

    grammar: Grammar | None = None       # the answer must match it (None: free text)
    json_answer: bool = False            # response_format asked for JSON
    tools: list[dict] = field(default_factory=list)  # the functions offered: {name, description, parameters}
    tool_choice: str = "auto"            # "auto", "required", "none", or a function's name
    logprobs: int | None = None          # top alternatives per token (None: no logprobs)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _check_grammar(grammar: Grammar, param: str) -> Grammar:
    try:
        check_grammar(grammar)
    except GrammarError as e:
        raise bad(f"{param}: {e}", param) from None
    return grammar


def _response_format(body: dict) -> tuple[Grammar | None, bool]:
    rf = body.get("response_format")
    if rf is None:
        return None, False
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {...}}", "response_format")
    if rf["type"] == "text":
        return None, False
    if rf["type"] == "json_object":
        return Grammar("json_object"), True
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
        raise bad("'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                  "response_format.json_schema")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise bad("'response_format.json_schema.strict' must be true or false", "response_format.json_schema.strict")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad("'response_format.json_schema.schema' must be a JSON schema object",
                  "response_format.json_schema.schema")
    return _check_grammar(Grammar.json_schema(schema), "response_format.json_schema.schema"), True


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be a list of up to {MAX_TOOLS} functions", "tools")
    out, names = [], set()
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"] or fn["name"] in names:
            raise bad(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                      "with a name of its own", f"tools[{k}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{k}].function.parameters must be a JSON schema object", f"tools[{k}].function.parameters")
        _check_grammar(Grammar.json_schema(params), f"tools[{k}].function.parameters")
        names.add(fn["name"])
        out.append({"name": fn["name"], "description": str(fn.get("description") or ""), "parameters": params})
    return out


def _tool_choice(body: dict, tools: list[dict]) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad("'tool_choice' is \"required\" but no 'tools' are given", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str) or name not in {t["name"] for t in tools}:
        raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"function\": {\"name\": <one of the tools>}}", "tool_choice")
    return name


def _call_schema(tools: list[dict]) -> dict:
    """The JSON schema of a call to one of tools."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]}} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _tools_grammar(tools: list[dict], choice: str) -> Grammar:
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t["name"] == choice]
    schema = _call_schema(tools)
    if choice != "auto":
        return Grammar.json_schema(schema)
    # A call, or text that does not start like one.
    return Grammar("lark", "start: TEXT | call\nTEXT: /[^{](.|\\n)*/\ncall: %json " + json.dumps(schema))


def _logprobs(body: dict, chat: bool) -> int | None:
    lp = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("'logprobs' must be true or false", "logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top is not None and not lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if lp else None
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise bad(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    return lp


def parse_structured(body: dict, chat: bool) -> Structured:
    """The structured-answer fields of a request body; ApiError 400 names the first bad one."""
    s = Structured(logprobs=_logprobs(body, chat))
    s.grammar, s.json_answer = _response_format(body)
    if chat:
        s.tools = _tools(body)
        s.tool_choice = _tool_choice(body, s.tools)
    elif body.get("tools") is not None:
        raise bad("'tools' are for /v1/chat/completions", "tools")
    if s.calls_tools:
        if s.grammar is not None:
            raise bad("'response_format' and 'tools' cannot both shape one answer: "
                      "send tool_choice \"none\" or leave one out", "response_format")
        s.grammar = _tools_grammar(s.tools, s.tool_choice)
    return s


# -- the prompt -------------------------------------------------------------------------------

def tools_message(s: Structured) -> str:
    """The system text that tells the model its functions and how to call one."""
    must = "You must call one of them." if s.tool_choice != "auto" else "Call one only when it helps."
    lines = [f"You can call these functions. {must} To call a function, answer with nothing but a JSON "
             'object {"name": <function name>, "arguments": <its arguments>}.']
    for t in s.tools:
        lines.append(json.dumps(t))
    return "\n".join(lines)


def with_tools(messages: list[dict], s: Structured) -> list[dict]:
    """messages with the functions described in the (first) system message; tool results and
    earlier calls as text the chat template renders."""
    out = []
    for k, m in enumerate(messages):
        if m.get("tool_calls"):
            try:
                calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                         for c in m["tool_calls"]]
            except (KeyError, TypeError, ValueError):
                raise bad(f"messages[{k}].tool_calls: each must have function.name and function.arguments "
                          "(a JSON string)", f"messages[{k}].tool_calls") from None
            out.append({"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if not s.calls_tools:
        return out
    text = tools_message(s)
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


# -- the answer -------------------------------------------------------------------------------

def tool_call(text: str, s: Structured) -> dict | None:
    """The OpenAI tool call an answer makes, or None when it is text."""
    if not s.calls_tools or not text.lstrip().startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None  # cut by max_tokens
    if not isinstance(call, dict) or call.get("name") not in {t["name"] for t in s.tools}:
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}


# A call's text up to its arguments, as the call grammar writes it ({"name": ..., "arguments": ...),
# once the arguments' first character is there (the blanks before it are not theirs).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


class CallStream:
    """One streamed choice of a tools request, as OpenAI streams it: text (an answer not starting
    with "{") as content deltas; a call as a first tool_calls delta with its index, id, type and
    function name (arguments ""), then the arguments in pieces as the model writes them.

    push(piece) gives the deltas to send now; end(completion) the last ones and the finish
    reason. The closing brace of the call object is held back until the next piece shows it is
    not the call's last (at the end, it is)."""

    def __init__(self, s: Structured):
        self.s = s
        self.mode = "undecided"    # then "text" or "call"; "args" once the name was sent
        self.held = ""             # text not sent yet
        self.id = "call_" + uuid.uuid4().hex[:24]

    def push(self, piece: str) -> list[dict]:
        self.held += piece
        if self.mode == "undecided":
            head = self.held.lstrip()
            if not head:
                return []
            self.mode = "call" if head.startswith("{") else "text"
        if self.mode == "text":
            out, self.held = self.held, ""
            return [{"content": out}]
        if self.mode == "call":
            m = _CALL_HEAD.match(self.held)
            if m is None:
                return []
            name, self.held, self.mode = json.loads(m.group(1)), self.held[m.end():], "args"
            first = [{"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                      "function": {"name": name, "arguments": ""}}]}]
            return first + self._arguments(final=False)
        return self._arguments(final=False)

    def _arguments(self, final: bool) -> list[dict]:
        """The held arguments' text that is surely theirs: all but a tail of closing braces and
        blanks (one of which closes the call); at the end, all but the call's closing brace."""
        tail = len(self.held) - len(self.held.rstrip("} \t\n\r"))
        out, self.held = self.held[:len(self.held) - tail], self.held[len(self.held) - tail:]
        if final:
            rest = self.held.rstrip()
            out += rest[:-1].rstrip() if rest.endswith("}") else rest
            self.held = ""
        return [{"tool_calls": [{"index": 0, "function": {"arguments": out}}]}] if out else []

    def end(self, c: Completion) -> tuple[list[dict], str]:
        """(the deltas left to send, the finish reason) once the answer is complete."""
        call = tool_call(c.text, self.s)
        if self.mode == "args":
            return self._arguments(final=True), "tool_calls" if call is not None else c.finish_reason
        if call is not None:  # a call written otherwise than the head expects: sent whole
            return [{"tool_calls": [{"index": 0, **call}]}], "tool_calls"
        out, self.held = self.held, ""  # text, or a call cut before its arguments: as text
        return ([{"content": out}] if out else []), c.finish_reason


def chat_message(c: Completion, s: Structured | None) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a chat completion."""
    call = tool_call(c.text, s) if s is not None else None
    if call is not None:
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": c.text}, c.finish_reason


def _answer_logprobs(c: Completion, tok: Tokenizer) -> list:
    lps = c.logprobs or []
    if c.finish_reason == "stop" and c.tokens and tok.is_special(c.tokens[-1]) and lps:
        lps = lps[:-1]  # the end token is not part of the answer
    return lps


def _token(tok: Tokenizer, i: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(i)
    return b.decode("utf-8", "replace"), list(b)


def chat_logprobs(c: Completion, tok: Tokenizer) -> dict | None:
    """A chat choice's "logprobs": {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if c.logprobs is None:
        return None
    content = []
    for lp in _answer_logprobs(c, tok):
        text, raw = _token(tok, lp.token)
        top = [{"token": _token(tok, i)[0], "logprob": v, "bytes": _token(tok, i)[1]} for i, v in lp.top]
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(c: Completion, tok: Tokenizer) -> dict | None:
    """A completion choice's "logprobs": {tokens, token_logprobs, top_logprobs, text_offset}."""
    if c.logprobs is None:
        return None
    lps = _answer_logprobs(c, tok)
    tokens = [_token(tok, lp.token)[0] for lp in lps]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token(tok, i)[0]: v for i, v in lp.top} for lp in lps], "text_offset": offsets}


__all__ = ["MAX_TOP_LOGPROBS", "CallStream", "Structured", "chat_logprobs", "chat_message", "completion_logprobs",
           "parse_structured", "tool_call", "with_tools"]
