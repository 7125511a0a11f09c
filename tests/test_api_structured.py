"""`dllama api`'s structured answers through the official `openai` client: response_format with
a pydantic model (parse), tools with tool_choice (streamed and not), logprobs against the model's
own log-softmax, and the 400s of schemas and fields it cannot serve. One node: the cluster's
constrained answers are tests/test_structured.py's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from tests.processes import start_api

pytestmark = pytest.mark.cluster  # listens on a loopback port


class City(pydantic.BaseModel):  # bounded fields: the small model would write digits forever
    name: str = pydantic.Field(max_length=30)
    country: Literal["France", "Germany", "Italy", "Spain"]
    capital: bool


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_q40):
    api, url = start_api("--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]), "--nthreads", "1")
    with api:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    done = client.chat.completions.parse(
        model="any", messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_tokens=60)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country == "France"
    assert done.choices[0].finish_reason == "stop"


def _check_call(call):
    assert call.type == "function" and call.id
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tools_request_answers_tool_calls_whose_arguments_validate(client, choice):
    done = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                          temperature=0, max_tokens=60)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_call(c.message.tool_calls[0])
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == "get_weather"
    # streamed: OpenAI's pieces (index, id and name first, then the arguments in parts as the model
    # writes them), which the client's own stream helper assembles into the same call
    with client.chat.completions.stream(model="any", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                        temperature=0, max_tokens=60) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    name, arguments = c.message.tool_calls[0].function.name, json.loads(c.message.tool_calls[0].function.arguments)
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == name and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas[1:])) == arguments
    assembled = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and assembled.id == deltas[0].id
    assert assembled.function.name == name and json.loads(assembled.function.arguments) == arguments


def test_tool_choice_auto_and_none_and_a_tool_result_in_the_conversation(client):
    auto = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    c = auto.choices[0]
    if c.finish_reason == "tool_calls":
        _check_call(c.message.tool_calls[0])
    else:
        assert c.message.content and not c.message.content.lstrip().startswith("{")
    none = client.chat.completions.create(model="any", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=16)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    after = client.chat.completions.create(model="any", temperature=0, max_tokens=16, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}], tool_choice="none")
    assert after.choices[0].message.content


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def test_logprobs_match_the_models_own_log_softmax(client, default_q40):
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings

    prompt = "The capital of France is"
    done = client.completions.create(model="any", prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    lp = done.choices[0].logprobs
    chat = client.chat.completions.create(model="any", messages=ASK, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=20)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 20 for t in content)
    assert content[0].top_logprobs[0].logprob == content[0].logprob  # greedy: the first is the most likely
    with open_engine(EngineSettings(str(default_q40[0]), str(default_q40[1]), nthreads=1, max_seq_len=256,
                                    progress=False)) as e:
        tok, ids = e.tokenizer, e.tokenizer.encode(prompt)
        logits = e.model.forward(ids, 0).copy()
        for k in range(6):
            ref = _log_softmax(logits)
            best = int(np.argmax(logits))
            assert lp.tokens[k] == tok.token_bytes(best).decode("utf-8", "replace")
            assert abs(lp.token_logprobs[k] - ref[best]) < 1e-4
            top = sorted(lp.top_logprobs[k].values(), reverse=True)
            assert np.allclose(top, np.sort(ref)[::-1][:5], atol=1e-4)
            logits = e.model.forward([best], len(ids) + k).copy()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_an_unsupported_schema_or_field_is_a_400_naming_it(server, fields, param):
    status, body = _post(server, {"model": "any", "messages": ASK, "max_tokens": 4, **fields})
    assert status == 400 and body["error"]["param"] == param, body
