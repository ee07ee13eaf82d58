"""Structured outputs over HTTP and the websocket on the default model, through the official ``openai``
client: ``response_format`` (JSON Schema, sampled n=3 and streamed), vLLM's ``structured_outputs``
(regex, choice) in completions, chat and the websocket, and 400s for constraints that do not compile."""

from __future__ import annotations

import json
import re

import aiohttp
import openai
import pytest

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.app import create_app
from tests.entrypoints.server_thread import ServerThread, run, wait_pool_empty

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person. Reply with their name and age as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=16)
    srv = ServerThread(create_app(config, max_tokens_limit=512)).start()
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_person(text):
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and value["age"] >= 0


def test_json_schema_n3_sampled_and_streamed(server, client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=RESPONSE_FORMAT, n=3, temperature=1.0, seed=5, max_tokens=200
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        check_person(choice.message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=RESPONSE_FORMAT, temperature=0.7, seed=2, max_tokens=200, stream=True
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    check_person(text)
    wait_pool_empty(server)


def test_json_object_regex_and_choice(server, client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=100
    )
    choice = out.choices[0]
    assert choice.message.content.startswith("{") and "  " not in choice.message.content  # compact
    if choice.finish_reason == "stop":  # any object may also run past max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    out = client.completions.create(
        model=MODEL,
        prompt="The date of the storming of the Bastille:",
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{1,2} [A-Z][a-z]+ [0-9]{4}"}},
    )
    assert re.fullmatch(r"[0-9]{1,2} [A-Z][a-z]+ [0-9]{4}", out.choices[0].text), out.choices[0].text
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        max_tokens=5,
        temperature=0.9,
        n=2,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert all(c.message.content in ("yes", "no") and c.finish_reason == "stop" for c in out.choices)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
            "response_format",
        ),
        (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
        (dict(extra_body={"structured_outputs": {"grammar": "start: undefined_rule"}}), "structured_outputs.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_400(server, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, **kwargs)
    assert e.value.body["param"] == param and "does not compile" in e.value.body["message"]
    wait_pool_empty(server)


def test_websocket_structured_outputs(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json(
                    {
                        "type": "generate",
                        "id": "a",
                        "messages": [{"role": "user", "content": "Pick a colour."}],
                        "max_tokens": 8,
                        "structured_outputs": {"choice": ["red", "green", "blue"]},
                    }
                )
                text = ""
                while True:
                    msg = json.loads((await ws.receive(timeout=60)).data)
                    assert msg["type"] != "error", msg
                    if msg["type"] == "delta":
                        text += msg.get("text", "")
                    if msg.get("finish_reason") or msg["type"] == "done":
                        return text, msg

    text, last = run(main())
    assert text in ("red", "green", "blue"), (text, last)
