"""The HTTP/websocket server on the real default model: OpenAI API through the official ``openai`` client
(streaming and not, completions and chat, n=2), structured outputs, the websocket protocol, concurrency,
disconnects (every block back), bad input (400 while a concurrent stream goes on), health, metrics and the
API key.

The server runs in-process in a background thread with its own event loop, on a free port.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("openai")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json
import logging
import re
import threading

import aiohttp
import openai

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.generation.chat_utils import tools_system_prompt
from tests.conftest import FIXTURES
from tests.entrypoints.server_thread import (
    ServerThread,
    get_json,
    run,
    served,
    sse,
    stats,
    wait_pool_empty,
    ws_generate,
)

model = pytest.mark.model  # tests that run the real default model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS_LIMIT = 512
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_seqs=32
    )
    with served(config, max_tokens_limit=MAX_TOKENS_LIMIT) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ------------------------------------------------------------------------------------------ OpenAI API
@model
def test_health_and_models(server, client):
    status, body = run(get_json(server.url + "/health"))
    assert status == 200 and body["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@model
def test_completions_stream_equals_nonstream_n2(server, client, caplog):
    caplog.set_level(logging.INFO, logger="rawpaged.server")
    prompt = "Once upon a time, there was a little girl named"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL
    assert sorted(c.index for c in full.choices) == [0, 1]
    texts = {c.index: c.text for c in full.choices}
    assert texts[0] == texts[1] and texts[0].startswith(" Emma who loved to play")
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.prompt_tokens == 11 and full.usage.completion_tokens == 16

    streamed = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == texts and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 16 and usage.prompt_tokens == 11

    # token-id prompts (a list of lists), echo, per-prompt choice indices
    ids = server.state.engine.tokenizer.encode(prompt)
    multi = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=2, temperature=0, echo=True)
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.choices[0].text.startswith(prompt)
    continuation = multi.choices[0].text[len(prompt) :]
    assert continuation and texts[0].startswith(continuation)
    assert multi.usage.prompt_tokens == 16
    # one INFO line per request: id, tokens, finish reason, latency
    lines = [r.getMessage() for r in caplog.records if r.name == "rawpaged.server" and full.id in r.getMessage()]
    assert len(lines) == 1 and "completion_tokens=16" in lines[0] and "finish_reason=length" in lines[0]
    assert "latency=" in lines[0]
    wait_pool_empty(server)


@model
def test_chat_capital_of_france_stream_and_not_n2(server, client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16, n=2)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert [c.message.content for c in full.choices] == ["The capital of France is Paris."] * 2
    assert [c.finish_reason for c in full.choices] == ["stop", "stop"]
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 16  # 8 tokens (with <|im_end|>) per choice

    roles, content, finish = {}, {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=16, n=2, stream=True
    ):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.setdefault(c.index, c.delta.role)
                assert content[c.index] == ""  # the role comes first
            content[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert content == {0: "The capital of France is Paris.", 1: "The capital of France is Paris."}
    assert finish == {0: "stop", 1: "stop"}

    lp = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=2, logprobs=True, top_logprobs=3
    )
    content_lp = lp.choices[0].logprobs.content
    assert [t.token for t in content_lp] == ["The", " capital"]
    assert len(content_lp[0].top_logprobs) == 3 and content_lp[0].top_logprobs[0].token == "The"
    wait_pool_empty(server)


@model
def test_sixteen_concurrent_streams(server):
    async def one(aclient, i):
        text, finish = "", None
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=6, temperature=0.8, seed=i, stream=True
        )
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(16)))
        finally:
            await aclient.close()

    results = run(main())
    assert len(results) == 16
    assert all(finish in ("length", "stop") and text for text, finish in results), results
    wait_pool_empty(server)


@model
def test_client_disconnect_frees_blocks(server):
    before = stats(server)["generation_tokens_total"]

    async def stream_then_leave():
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server.url + "/v1/completions",
                json={
                    "prompt": "Write a long story about a dragon.",
                    "max_tokens": 400,
                    "stream": True,
                    "ignore_eos": True,
                },
            ) as r:
                got = 0
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got += 1
                        if got == 3:
                            break  # leave mid-stream: the connection closes with the session

    async def nonstream_then_leave():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(
                    server.url + "/v1/completions",
                    json={"prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True},
                    timeout=aiohttp.ClientTimeout(total=1.5),
                ) as r:
                    await r.read()

    run(stream_then_leave())
    run(nonstream_then_leave())
    after = wait_pool_empty(server)
    # aborted long before their 400 tokens each
    assert after["generation_tokens_total"] - before < 400


# ------------------------------------------------------------------------------------------ websocket
@model
def test_websocket_concurrent_requests_cancel_and_close(server, client):
    greedy = (
        client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=0)
        .choices[0]
        .text
    )

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json(
                    {
                        "type": "generate",
                        "id": "a",
                        "prompt": "The three primary colors are",
                        "max_tokens": 8,
                        "temperature": 0,
                    }
                )
                await ws.send_json(
                    {"type": "generate", "id": "b", "messages": FRANCE, "max_tokens": 16, "temperature": 0, "n": 2}
                )
                await ws.send_json(
                    {"type": "generate", "id": "c", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
                )
                await ws.send_json({"type": "generate", "id": "d", "prompt": "x", "temperature": -1})
                await ws.send_json({"type": "cancel", "id": "nope"})
                await ws.send_str("{not json")
                text, ids, done, errors = {}, {}, {}, []
                cancelled = False
                while len(done) < 4:
                    msg = json.loads((await ws.receive(timeout=60)).data)
                    key = (msg.get("id"), msg.get("index"))
                    if msg["type"] == "delta":
                        assert key not in done
                        text[key] = text.get(key, "") + msg["text"]
                        ids[key] = ids.get(key, []) + msg["token_ids"]
                        if msg["id"] == "c" and not cancelled:
                            cancelled = True
                            await ws.send_json({"type": "cancel", "id": "c"})
                    elif msg["type"] == "done":
                        done[key] = msg
                    else:
                        assert msg["type"] == "error"
                        errors.append(msg)
                return text, ids, done, errors

    text, ids, done, errors = run(main())
    assert text[("a", 0)] == greedy and len(ids[("a", 0)]) == 8
    assert done[("a", 0)]["finish_reason"] == "length"
    n_prompt = len(server.state.engine.tokenizer.encode("The three primary colors are"))
    assert done[("a", 0)]["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 8}
    for i in (0, 1):
        assert text[("b", i)] == "The capital of France is Paris."
        assert done[("b", i)]["finish_reason"] == "stop"
    assert done[("c", 0)]["finish_reason"] == "abort"
    assert len(ids[("c", 0)]) < 200
    by_id = {e["id"]: e for e in errors}
    assert by_id["d"]["param"] == "temperature" and by_id["d"]["status"] == 400
    assert by_id["nope"]["param"] == "id"
    assert None in by_id  # the malformed message
    wait_pool_empty(server)

    async def close_mid_stream():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                for i in range(3):
                    await ws.send_json(
                        {"type": "generate", "id": i, "prompt": "Hello", "max_tokens": 300, "ignore_eos": True}
                    )
                while json.loads((await ws.receive(timeout=60)).data)["type"] != "delta":
                    pass
            # leaving the block closes the socket with three requests running

    before = stats(server)["generation_tokens_total"]
    run(close_mid_stream())
    after = wait_pool_empty(server)
    assert after["generation_tokens_total"] - before < 3 * 300


# ------------------------------------------------------------------------------------------ bad input
BIG_PROMPT = [100] * (MAX_MODEL_LEN + 10)
BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": BIG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": [100] * 600, "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10**8]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": FRANCE, "bad_words": [""]}, 400, "bad_words"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": "yes"}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
]


@model
def test_bad_inputs_get_400_while_a_stream_continues(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            body = {
                "prompt": "The history of the Roman empire",
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            background = asyncio.create_task(sse(s, server.url + "/v1/completions", body))
            await asyncio.sleep(0.2)
            results = []
            for path, payload, status, param in BAD_REQUESTS:
                kw = (
                    {"data": payload, "headers": {"Content-Type": "application/json"}}
                    if isinstance(payload, bytes)
                    else {"json": payload}
                )
                async with s.post(server.url + path, **kw) as r:
                    results.append(
                        (
                            path,
                            payload if isinstance(payload, dict) else payload[:20],
                            status,
                            param,
                            r.status,
                            await r.json(),
                        )
                    )
            assert not background.done() or background.exception() is None
            chunks, done = await background
            return results, chunks, done

    results, chunks, done = run(main())
    for path, payload, status, param, got_status, body in results:
        where = f"{path} {str(payload)[:80]}: {got_status} {body}"
        assert got_status == status, where
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert err["param"] == param and err["message"], where
        if status == 400:
            assert err["type"] == "invalid_request_error", where
    assert done and chunks[-1]["usage"]["completion_tokens"] == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    wait_pool_empty(server)


@model
def test_openai_client_errors(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, n=100)
    assert e.value.body["param"] == "n"


# ------------------------------------------------------------------------------------------ health, metrics
@model
def test_metrics(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            # At least one finished request, so the counters and histograms have something to show.
            async with s.post(
                server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}
            ) as r:
                assert r.status == 200, await r.text()
            async with s.get(server.url + "/metrics") as r:
                return r.status, r.headers["Content-Type"], await r.text()

    status, ctype, text = run(main())
    assert status == 200 and ctype.startswith("text/plain")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "rawpaged:num_requests_running",
        "rawpaged:num_requests_waiting",
        "rawpaged:kv_cache_usage_perc",
        "rawpaged:num_preemptions_total",
        "rawpaged:num_free_blocks",
        "rawpaged:num_total_blocks",
        "rawpaged:num_used_blocks",
        "rawpaged:num_shared_blocks",
        "rawpaged:num_cached_blocks",
        "rawpaged:prefix_cache_queries_total",
        "rawpaged:prefix_cache_hits_total",
        "rawpaged:cow_copies_total",
    ):
        assert name in values, name
    assert values["rawpaged:num_total_blocks"] == 256
    assert values["rawpaged:prompt_tokens_total"] > 0 and values["rawpaged:generation_tokens_total"] > 0
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert values[f"rawpaged:{hist}_count"] > 0, hist
        assert f'rawpaged:{hist}_bucket{{le="+Inf"}}' in values


def test_health_503_while_loading_api_key_and_load_failure():
    release = threading.Event()

    def loader():
        release.wait(30)
        raise RuntimeError("--device cuda: no CUDA device\nsecond line")

    app = create_app(EngineConfig(model="/nonexistent/TinyModel"), loader=loader, api_key="sekret")
    srv = ServerThread(app).start()
    try:

        async def main():
            async with aiohttp.ClientSession() as s:
                out = {}
                for name, path, headers in (
                    ("health", "/health", {}),
                    ("metrics", "/metrics", {}),
                    ("no_key", "/v1/models", {}),
                    ("bad_key", "/v1/models", {"Authorization": "Bearer nope"}),
                    ("models", "/v1/models", {"Authorization": "Bearer sekret"}),
                    ("ws_no_key", "/v1/ws", {}),
                ):
                    async with s.get(srv.url + path, headers=headers) as r:
                        out[name] = (r.status, await r.text())
                async with s.post(
                    srv.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekret"}
                ) as r:
                    out["generate"] = (r.status, await r.json())
                return out

        out = run(main())
        assert out["health"][0] == 503 and json.loads(out["health"][1])["status"] == "loading"
        assert out["metrics"][0] == 200
        for name in ("no_key", "bad_key", "ws_no_key"):
            assert out[name][0] == 401, name
            assert json.loads(out[name][1])["error"]["type"] == "authentication_error"
        assert out["models"][0] == 200 and json.loads(out["models"][1])["data"][0]["id"] == "TinyModel"
        assert out["generate"][0] == 503 and "loading" in out["generate"][1]["error"]["message"]
    finally:
        release.set()
    srv._thread.join(30)  # the failed load ends the server by itself ...
    assert not srv._thread.is_alive()
    assert srv.exit_code == 1  # ... with exit code 1


@model
def test_beam_search_over_http_matches_hf(server):
    ref = json.loads((FIXTURES / "reference_beam.json").read_text())
    p = ref["prompts"][0]

    async def main():
        async with aiohttp.ClientSession() as s:
            body = {
                "prompt": p["prompt_token_ids"],
                "max_tokens": 16,
                "n": 4,
                "use_beam_search": True,
                "length_penalty": 1.0,
            }
            async with s.post(server.url + "/v1/completions", json=body) as r:
                ok = (r.status, await r.json())
            async with s.post(server.url + "/v1/completions", json={**body, "stream": True}) as r:
                bad = (r.status, await r.json())
        return ok, bad

    (status, out), (bad_status, bad) = run(main())
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] == p["beams"][0]["output_text"].replace("<|im_end|>", "")
    assert bad_status == 400 and bad["error"]["param"] == "use_beam_search"


# ------------------------------------------------------------------------------------------ structured outputs
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person. Reply with their name and age as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def check_person(text):
    value = json.loads(text)
    pytest.importorskip("jsonschema").validate(value, strict_schema(SCHEMA))
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and value["age"] >= 0


@model
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


@model
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
@model
def test_a_constraint_that_does_not_compile_is_a_400(server, client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, **kwargs)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(f"{param} does not compile")
    wait_pool_empty(server)


@model
def test_websocket_structured_outputs(server):
    message = {
        "id": "a",
        "messages": [{"role": "user", "content": "Pick a colour."}],
        "max_tokens": 8,
        "structured_outputs": {"choice": ["red", "green", "blue"]},
    }
    text, last = run(ws_generate(server.url, message))
    assert text in ("red", "green", "blue"), (text, last)


# ------------------------------------------------------------------------------------------ tools
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "maxLength": 30}},
                "required": ["tz"],
            },
        },
    },
]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(name, arguments):
    jsonschema = pytest.importorskip("jsonschema")
    assert name in TOOL_SCHEMAS
    jsonschema.validate(json.loads(arguments), strict_schema(TOOL_SCHEMAS[name]))


def strict_schema(schema: dict) -> dict:
    """What the server enforces by default: objects admit only the properties they list."""
    from rawpaged.structured_output.json_schema import no_additional_properties

    return no_additional_properties(schema)


def streamed_tool_calls(stream):
    """(content, {index: [id, name, arguments]}, finish_reason) of one streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


@model
def test_named_tool_choice_gives_a_valid_call_streamed_or_not(server, client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=100
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(
        model=MODEL, messages=WEATHER_ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=100, stream=True
    )
    content, calls, finish = streamed_tool_calls(stream)
    assert content == "" and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls.values()] == [("get_weather", call.function.arguments)]
    wait_pool_empty(server)


CITY_TOOL = [  # the schema a new user writes: no additionalProperties
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@model
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_schema_without_additional_properties_ends_its_call(server, client, choice):
    """A parameters schema that does not say additionalProperties compiles strict: the call ends with
    valid arguments well within 60 tokens, greedy and sampled (by the letter of JSON Schema the model
    invented keys until max_tokens)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = CITY_TOOL[0]["function"]["parameters"]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    for kw in (dict(temperature=0), dict(n=3, seed=7)):
        out = client.chat.completions.create(
            model=MODEL, messages=WEATHER_ASK, tools=CITY_TOOL, tool_choice=tool_choice, max_tokens=60, **kw
        )
        assert out.usage.completion_tokens < 50 * len(out.choices), out.usage  # the limit is 60 each
        for c in out.choices:
            assert c.finish_reason == "tool_calls", c
            for call in c.message.tool_calls:
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, strict_schema(schema))
                assert set(args) == {"city"}
    wait_pool_empty(server)


NESTED = {  # nested objects, arrays of objects and anyOf branches, none saying additionalProperties
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
        "days": {
            "type": "array",
            "maxItems": 2,
            "items": {"type": "object", "properties": {"day": {"type": "string", "maxLength": 10}}},
        },
        "unit": {"anyOf": [{"type": "object", "properties": {"name": {"enum": ["C", "F"]}}}, {"type": "null"}]},
    },
    "required": ["city", "location", "days", "unit"],
}


@model
def test_nested_json_schema_output_validates_strict(server, client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": NESTED}},
        n=3,
        seed=11,
        max_tokens=120,
    )
    for c in out.choices:
        assert c.finish_reason == "stop", c
        value = json.loads(c.message.content)
        pytest.importorskip("jsonschema").validate(value, strict_schema(NESTED))
    wait_pool_empty(server)


@model
def test_required_tool_choice_n2_sampled_and_streamed(server, client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice="required",
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    content, calls, finish = streamed_tool_calls(stream)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    [(_, name, arguments)] = calls.values()
    check_call(name, arguments)
    wait_pool_empty(server)


@model
def test_auto_tool_choice_streams_as_it_answers_and_tool_results_go_back(server, client):
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = streamed_tool_calls(client.chat.completions.create(**kw, stream=True))
    assert content == (full.message.content or "") and finish == full.finish_reason
    assert [(n, a) for _, n, a in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls or ()
    ]
    assert (finish == "tool_calls") == bool(calls)
    # A whole round: the call and its result go back; SmolLM2's template has no tools, so they are
    # written into its messages (rawpaged.entrypoints.generation.chat_utils).
    conversation = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    tok = server.state.engine.tokenizer
    text, ids = tok.encode_chat(
        [
            {"role": "system", "content": tools_system_prompt(TOOLS)},
            WEATHER_ASK[0],
            {
                "role": "assistant",
                "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                "</tool_call>",
            },
            {"role": "user", "content": '<tool_response>\n{"temperature": 18, "sky": "sunny"}\n</tool_response>'},
        ]
    )
    assert answer.usage.prompt_tokens == len(ids)
    wait_pool_empty(server)


@model
def test_a_tool_schema_that_does_not_compile_is_a_400(server, client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=bad, tool_choice="required", max_tokens=10)
    assert e.value.body["param"] == "tools"
    assert e.value.body["message"].startswith("tools: one of the parameters schemas does not compile: ")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"
    wait_pool_empty(server)
