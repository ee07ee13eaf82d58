"""Property test: random, extreme and ill-typed values in every field of both HTTP APIs and the websocket,
each sent while a fixed greedy request runs beside it. The greedy request's text never changes, no
response is a 5xx (nor a 5xx error inside a stream), and every block returns to the pool. On a small
random model (fast), then a shorter run on the default model."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.generation.request_body import parse_request
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.entrypoints.websocket.protocol import WebSocketGenerateRequest
from tests.entrypoints.server_thread import ServerThread, run, wait_pool_empty

FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "n", "best_of", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "stream",
    "stream_options", "echo", "use_beam_search", "length_penalty", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "suffix", "user", "response_format", "tools", "min_tokens", "bad_words",
    "allowed_token_ids", "prompt_logprobs",
)  # fmt: skip
EXTREME = st.sampled_from([
    0, 1, -1, 2, 16, 17, 64, 65, 2**31, 2**63, 2**63 + 5, 2**64, -(2**63) - 1, 5e-324, 1e-308, 1e-6, 1e-5,
    0.5, 1e308, -0.0, 400.0, -1000.0, float("inf"), float("-inf"), float("nan"), "", "<|im_end|>", "0",
    [], [""], [0], [2**63], {}, {"include_usage": "yes"}, {"type": "json_object"},
])  # fmt: skip
VALUES = st.one_of(
    EXTREME,
    EXTREME,
    EXTREME,
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(-5, 10**6), st.text(max_size=4)), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=2),
)

BASE = {
    "completions": {"prompt": "abc", "max_tokens": 4},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "ws": {"prompt": "abc", "max_tokens": 4},
}
FIXED = {"prompt": "the fixed greedy request", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
LIMIT = 32


def _server(model: str, **kw) -> ServerThread:
    config = EngineConfig(model=model, device="cpu", num_kv_blocks=256, max_model_len=256, **kw)
    srv = ServerThread(create_app(config, max_tokens_limit=LIMIT)).start()
    srv.wait_healthy()
    return srv


async def fixed_text(session, url) -> str:
    async with session.post(url + "/v1/completions", json=FIXED) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def fuzzed_http(session, url, path, body) -> None:
    async with session.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        assert r.status < 500, (body, r.status, await r.text())
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            async for line in r.content:
                assert b"internal_server_error" not in line, (body, line)
        else:
            await r.read()


async def fuzzed_ws(session, url, body) -> None:
    msg = {"type": "generate", "id": "f", **body}
    try:
        expected = parse_request(WebSocketGenerateRequest, json.loads(json.dumps(body)), _LIMITS).num_choices
    except (ProtocolError, ValueError):
        expected = 1
    async with session.ws_connect(url + "/v1/ws") as ws:
        await ws.send_str(json.dumps(msg))
        done = 0
        while done < expected:
            reply = json.loads((await ws.receive(timeout=60)).data)
            if reply["type"] == "error":
                assert reply["status"] < 500, (body, reply)
                return
            done += reply["type"] == "done"


_LIMITS = Limits(max_tokens=LIMIT)  # the server's, for predicting how many choices a websocket request answers


def fuzz(srv: ServerThread, reference: str, endpoint: str, mutation: dict) -> None:
    body = {**BASE[endpoint], **mutation}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            if endpoint == "ws":
                probe = fuzzed_ws(s, srv.url, body)
            else:
                probe = fuzzed_http(
                    s, srv.url, "/v1/completions" if endpoint == "completions" else "/v1/chat/completions", body
                )
            text, _ = await asyncio.gather(fixed_text(s, srv.url), probe)
            return text

    assert run(main()) == reference, body


ENDPOINTS = st.sampled_from(sorted(BASE))
MUTATIONS = st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_server(tiny_dir):
    srv = _server(str(tiny_dir))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(fuzz_server):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await fixed_text(s, fuzz_server.url)

    return run(main())


@pytest.mark.parametrize("field", FIELDS)
@settings(max_examples=15, **SETTINGS)
@given(endpoint=ENDPOINTS, value=VALUES, others=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=2))
def test_fuzzed_fields_never_hurt_another_request(fuzz_server, reference, field, endpoint, value, others):
    fuzz(fuzz_server, reference, endpoint, {**others, field: value})


def test_after_fuzzing_every_block_is_back(fuzz_server):
    s = wait_pool_empty(fuzz_server)
    assert s["num_used_blocks"] == 0 and fuzz_server.state.engine is not None


@pytest.mark.model
def test_fuzzed_fields_on_the_default_model(model_dir):
    srv = _server(str(model_dir))
    try:

        async def ref():
            async with aiohttp.ClientSession() as s:
                return await fixed_text(s, srv.url)

        reference_text = run(ref())

        @settings(max_examples=40, **SETTINGS)
        @given(endpoint=ENDPOINTS, mutation=MUTATIONS)
        def check(endpoint, mutation):
            fuzz(srv, reference_text, endpoint, mutation)

        check()
        wait_pool_empty(srv)
    finally:
        assert srv.stop() == 0
