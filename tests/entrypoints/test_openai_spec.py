"""The server's answers against OpenAI's own API schemas (``openai_schemas``: openai/openai-openapi at commit
f85dbe2, vendored in tests/fixtures/openai_openapi): chat (plain, with logprobs, stream chunks), completions
(plain and stream chunks), the model list and card (and the SDK's ``models.retrieve``), the Responses API's
response and stream events, and error bodies; then ``system_fingerprint`` and the usage counts of prefix
cache hits (``--enable-prompt-tokens-details``).

Where the schema's letter and OpenAI's real answers differ, the real answers win; the exceptions:

- a completions stream chunk is validated as ``CreateCompletionResponse`` (the spec has no chunk schema of
  its own) with ``finish_reason`` also null and ``usage`` also null: OpenAI sends ``finish_reason: null``
  in every chunk but the last and, with ``include_usage``, ``usage: null`` until the last chunk.
- the response in ``response.created`` and ``response.in_progress`` events has ``usage: null`` (the spec's
  ``Response.usage`` is not nullable): OpenAI sends null there, the counts come with the last event.

vLLM's extra fields (``reasoning``, ``prompt_logprobs``, a model card's ``root``/``max_model_len``) pass:
the schemas allow additional properties.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("jsonschema")

import json

import aiohttp

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.generation.fingerprint import system_fingerprint
from rawpaged.entrypoints.server.config import ServerConfig
from tests.entrypoints.openai_schemas import errors, stream_event_schema
from tests.entrypoints.server_thread import openai_client, run, served, sse

ASK = [{"role": "user", "content": "Say something."}]
#: a prompt of several full KV blocks (block_size 16), so a second request finds them in the prefix cache
LONG = "the quick brown fox jumps over the lazy dog " * 3


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=128, max_model_len=512)
    with served(config, max_tokens_limit=64, server_config=ServerConfig(enable_prompt_tokens_details=True)) as srv:
        yield srv


async def _post(url, body):
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def _get(url):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


def post(server, path, body):
    return run(_post(server.url + path, body))


def get(server, path):
    return run(_get(server.url + path))


def chat_body(server, **kw):
    return {"model": server.state.model_name, "messages": ASK, "max_tokens": 6, "seed": 0, **kw}


def completion_chunk_exceptions(schema: dict) -> None:
    """The completions stream's differences from ``CreateCompletionResponse`` (see the module doc)."""
    choice = schema["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    schema["properties"]["usage"] = {"anyOf": [schema["properties"]["usage"], {"type": "null"}]}


# ------------------------------------------------------------------------------------------ chat
def test_chat_response_and_its_logprobs_follow_the_spec(server):
    status, plain = post(server, "/v1/chat/completions", chat_body(server))
    assert status == 200 and errors("CreateChatCompletionResponse", plain) == []
    assert plain["choices"][0]["message"]["refusal"] is None
    status, lp = post(server, "/v1/chat/completions", chat_body(server, logprobs=True, top_logprobs=2))
    assert status == 200 and errors("CreateChatCompletionResponse", lp) == []
    assert lp["choices"][0]["logprobs"]["refusal"] is None and len(lp["choices"][0]["logprobs"]["content"]) > 0


def test_chat_stream_chunks_follow_the_spec(server):
    body = chat_body(server, stream=True, logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    chunks, done = run(_sse(server, "/v1/chat/completions", body))
    assert done and len(chunks) > 2
    for chunk in chunks:
        assert errors("CreateChatCompletionStreamResponse", chunk) == [], chunk
    with_logprobs = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"] is not None]
    assert with_logprobs and all(c["choices"][0]["logprobs"]["refusal"] is None for c in with_logprobs)


async def _sse(server, path, body):
    async with aiohttp.ClientSession() as s:
        return await sse(s, server.url + path, body)


# ------------------------------------------------------------------------------------------ completions
def test_completion_response_and_stream_chunks_follow_the_spec(server):
    body = {"model": server.state.model_name, "prompt": "Once upon", "max_tokens": 6, "logprobs": 2}
    status, plain = post(server, "/v1/completions", body)
    assert status == 200 and errors("CreateCompletionResponse", plain) == []
    chunks, done = run(
        _sse(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert done and len(chunks) > 2
    for chunk in chunks:
        assert errors("CreateCompletionResponse", chunk, completion_chunk_exceptions) == [], chunk
    # the exception is needed: the middle chunks do carry finish_reason null
    assert any(errors("CreateCompletionResponse", c) for c in chunks)


# ------------------------------------------------------------------------------------------ models
def test_model_list_and_card_follow_the_spec_and_the_sdk_retrieves_the_model(server):
    status, listing = get(server, "/v1/models")
    assert status == 200 and errors("ListModelsResponse", listing) == []
    name = server.state.model_name
    status, card = get(server, f"/v1/models/{name}")
    assert status == 200 and errors("Model", card) == [] and card["id"] == name
    model = openai_client(server).models.retrieve(name)
    assert (model.id, model.object, model.owned_by) == (name, "model", "rawpaged")


def test_an_unknown_model_is_a_404_in_openais_error_shape(server):
    status, body = get(server, "/v1/models/unknown")
    assert status == 404 and errors("ErrorResponse", body) == []
    assert body["error"]["code"] == "model_not_found"


def test_a_refused_request_has_openais_error_shape(server):
    status, body = post(server, "/v1/chat/completions", chat_body(server, temperature=-1))
    assert status == 400 and errors("ErrorResponse", body) == [] and body["error"]["param"] == "temperature"


# ------------------------------------------------------------------------------------------ responses
def test_responses_response_follows_the_spec_without_a_null_user(server):
    body = {"model": server.state.model_name, "input": "Say something.", "max_output_tokens": 6}
    status, response = post(server, "/v1/responses", body)
    assert status == 200 and errors("Response", response) == []
    assert "user" not in response
    assert response["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    status, named = post(server, "/v1/responses", {**body, "user": "u-1"})
    assert status == 200 and named["user"] == "u-1" and errors("Response", named) == []


async def _events(server, body) -> list:
    """The Responses stream's events, as sent (``event: <type>`` then ``data: <json>``)."""
    events = []
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        kind = None
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == kind
    return events


#: stands in for the null ``usage`` of a response still running (see the module doc)
USAGE_PLACEHOLDER = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}


def test_responses_stream_events_follow_the_spec(server):
    body = {"model": server.state.model_name, "input": "Say something.", "max_output_tokens": 6, "stream": True}
    events = run(_events(server, body))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.delta" in kinds
    for event in events:
        if event["type"] in ("response.created", "response.in_progress"):
            assert event["response"]["usage"] is None
            event = {**event, "response": {**event["response"], "usage": USAGE_PLACEHOLDER}}
        assert errors(stream_event_schema(event["type"]), event) == [], event
        assert errors("ResponseStreamEvent", event) == [], event["type"]


# ------------------------------------------------------------------------------------------ fingerprint
def test_system_fingerprint_is_stable_and_follows_the_output_settings(server, tiny_dir):
    _, a = post(server, "/v1/chat/completions", chat_body(server))
    _, b = post(server, "/v1/completions", {"model": server.state.model_name, "prompt": "x", "max_tokens": 2})
    fp = a["system_fingerprint"]
    assert fp == b["system_fingerprint"] and fp.startswith("fp_") and len(fp) == 15
    int(fp[3:], 16)
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=128, max_model_len=512)
    name = server.state.model_name
    assert system_fingerprint(config, name) == fp
    assert system_fingerprint(EngineConfig(model=str(tiny_dir), num_kv_blocks=7), name) == fp  # not an output setting
    for changed in ({"block_size": 32}, {"kv_cache_dtype": "bfloat16"}, {"quantization": "q8_0"}):
        assert system_fingerprint(EngineConfig(model=str(tiny_dir), **changed), name) != fp, changed
    assert system_fingerprint(config, "other-name") != fp


# ------------------------------------------------------------------------------------------ cached tokens
def test_prefix_cache_hits_are_reported_as_cached_tokens(server):
    name = server.state.model_name
    body = {"model": name, "prompt": LONG + "one", "max_tokens": 2}
    _, first = post(server, "/v1/completions", body)
    _, again = post(server, "/v1/completions", body)
    prompt_tokens = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached
    assert 0 < cached < prompt_tokens and cached % 16 == 0  # whole blocks; the last token always computed
    assert server.state.engine is not None
    chunks, _ = run(
        _sse(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    chat = {"model": name, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    post(server, "/v1/chat/completions", chat)
    _, hit = post(server, "/v1/chat/completions", chat)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    responses = {"model": name, "input": LONG + "two", "max_output_tokens": 2}
    post(server, "/v1/responses", responses)
    _, r = post(server, "/v1/responses", responses)
    assert r["usage"]["input_tokens_details"]["cached_tokens"] >= 16 and errors("Response", r) == []


def test_prompt_tokens_details_only_with_the_flag(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    with served(config, max_tokens_limit=8) as srv:
        body = {"model": srv.state.model_name, "prompt": LONG, "max_tokens": 2}
        post(srv, "/v1/completions", body)
        status, again = post(srv, "/v1/completions", body)
    assert status == 200 and "prompt_tokens_details" not in again["usage"]
    assert errors("CreateCompletionResponse", again) == []
