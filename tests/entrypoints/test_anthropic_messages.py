"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) driven by the official
``anthropic`` SDK: on the default model a plain turn, the same greedy text as ``/v1/chat/completions`` for
the same conversation (tools and tool results included), a streamed turn rebuilt by the SDK's stream
helper (and its raw named events), stop sequences, a tool round trip, prefix-cache hits in ``usage``,
count_tokens and bad input in Anthropic's error shape while other requests run; on a scripted Qwen3 model
with ``--reasoning-parser`` the ``thinking`` block and its signature; and, with no model loaded, the API key
by ``x-api-key`` or ``Authorization`` and the 401/529 errors in Anthropic's shape. The SDK no longer takes
``temperature`` as an argument, so it goes in ``extra_body``."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("openai")
pytest.importorskip("anthropic")

import json
import threading

import aiohttp
import anthropic

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from tests.entrypoints.server_thread import ServerThread, openai_client, run, served, wait_pool_empty
from tests.scripted_model import write_scripted_model
from tests.tokenizer_files import tokenizer_dir

model = pytest.mark.model  # tests that run the real default model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = "What is the capital of France?"
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]},
}


def anthropic_client(server, **kw):
    """The official ``anthropic`` client on ``server`` (no retries)."""
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **kw)


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=128, max_model_len=1024)
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server)


def ask(client, content=FRANCE, **kw):
    kw.setdefault("max_tokens", 16)
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": content}], extra_body=GREEDY, **kw)


@model
def test_a_plain_turn(server, client):
    r = ask(client, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    [block] = r.content
    assert block.type == "text" and "Paris" in block.text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert 0 < r.usage.output_tokens <= 16 and r.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": FRANCE}]
    )
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted.input_tokens > 5
    cut = ask(client, "Count from one to fifty.", max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    wait_pool_empty(server)


@model
def test_same_greedy_text_as_chat_completions(server, client):
    """One conversation (a system prompt as blocks, earlier turns, a tool call and its result) through
    both APIs: the same greedy text and the same prompt tokens."""
    chat = openai_client(server)
    cases = [
        (
            [
                {"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": FRANCE},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"},
            ],
            dict(
                system=[{"type": "text", "text": "You answer "}, {"type": "text", "text": "in one sentence."}],
                messages=[
                    {"role": "user", "content": [{"type": "text", "text": FRANCE}]},
                    {"role": "assistant", "content": "Paris."},
                    {"role": "user", "content": "And of Italy?"},
                ],
            ),
            {},
        ),
        (
            [
                {"role": "user", "content": "What is the weather like in Paris today?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
            ],
            dict(
                messages=[
                    {"role": "user", "content": "What is the weather like in Paris today?"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "call_1",
                                "content": [{"type": "text", "text": "sunny, 21 C"}],
                            }
                        ],
                    },
                ],
                tools=[WEATHER],
            ),
            dict(tools=[CHAT_WEATHER]),
        ),
    ]
    for messages, body, chat_tools in cases:
        want = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, **chat_tools)
        got = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, **body)
        text = "".join(b.text for b in got.content if b.type == "text")
        assert text == (want.choices[0].message.content or "") and text
        assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens
        assert got.usage.output_tokens == want.usage.completion_tokens
        assert {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason] == got.stop_reason
        counted = client.messages.count_tokens(model=MODEL, **body)
        assert counted.input_tokens == want.usage.prompt_tokens
    wait_pool_empty(server)


async def raw_events(url: str, body: dict) -> list:
    """A streamed request's events as ``(event name, data)``; every name must equal its data's ``type``."""
    events, name = [], None
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/messages", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                events.append((name, data))
    return events


@model
def test_a_streamed_turn_rebuilt_by_the_sdk(server, client):
    plain = ask(client)
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": FRANCE}], extra_body=GREEDY
    ) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text == "".join(deltas) and len(deltas) > 1
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == plain.usage.input_tokens + (
        plain.usage.cache_read_input_tokens
    )
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": FRANCE}], "stream": True}
    events = run(raw_events(server.url, body | GREEDY))
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens
    wait_pool_empty(server)


@model
def test_stop_sequences(server, client):
    plain = ask(client).content[0].text  # "The capital of France is Paris."
    assert "Paris" in plain
    r = ask(client, stop_sequences=["nowhere", "Paris"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    assert r.content[0].text == plain[: plain.index("Paris")]
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": FRANCE}], stop_sequences=["Paris"],
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence",
        "Paris",
        r.content[0].text,
    )
    unmatched = ask(client, stop_sequences=["nowhere"])
    assert unmatched.stop_reason == "end_turn" and unmatched.stop_sequence is None
    wait_pool_empty(server)


@model
def test_a_tool_round_trip(server, client):
    """A forced call (``tool_choice`` ``tool``, then ``any``) with its parsed ``input``, whole and streamed
    (``input_json_delta``), then its ``tool_result`` sent back and answered."""
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    kw = dict(model=MODEL, max_tokens=60, tools=[WEATHER], messages=question, extra_body=GREEDY)
    first = client.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    assert first.stop_reason == "tool_use"
    anyone = client.messages.create(**kw, tool_choice={"type": "any"})
    assert [(b.name, b.input) for b in anyone.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]
    with client.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        json_deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    [streamed_call] = streamed.content
    assert streamed_call.type == "tool_use" and streamed_call.input == call.input
    assert json.loads("".join(json_deltas)) == call.input and streamed.stop_reason == "tool_use"
    answer = client.messages.create(
        model=MODEL,
        max_tokens=32,
        tools=[WEATHER],
        extra_body=GREEDY,
        messages=[
            *question,
            {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
        ],
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > first.usage.input_tokens + (
        first.usage.cache_read_input_tokens
    )  # the call and its result are in the prompt
    wait_pool_empty(server)


@model
def test_output_config_format_constrains_the_text(server, client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    r = ask(client, max_tokens=30, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(r.content[0].text)) == {"city"} and r.stop_reason == "end_turn"


@model
def test_prefix_cache_hits_are_cache_read_input_tokens(server, client):
    long = "Here is a long story about a cat who travels the world. " * 12 + FRANCE
    first, again = ask(client, long, max_tokens=2), ask(client, long, max_tokens=2)
    total = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": long}]).input_tokens
    for r in (first, again):
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == total
    block = EngineConfig().block_size  # the server's
    # the first may hit the template's opening, cached by an earlier request; the second hits its whole prompt
    assert first.usage.cache_read_input_tokens < again.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= (total - 1) // block * block > 0
    assert again.usage.cache_read_input_tokens % block == 0


@model
def test_bad_input_in_anthropic_shape_while_others_run(server, client):
    """Refusals (no max_tokens, an unknown block type, an image, an unknown model, an unknown tool) are
    Anthropic's error bodies and statuses; a stream running meanwhile finishes, and every block is back."""
    user = [{"role": "user", "content": "Hi"}]
    with client.messages.stream(
        model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Count from one to fifty."}],
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        it = iter(stream)
        next(it)  # message_start: the request runs
        for body, status, needle in (
            ({"messages": user}, 400, "max_tokens is required"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "'video'"),
            (
                {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                400,
                "image",
            ),
            (
                {"max_tokens": 4, "messages": user, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
                400,
                "'x'",
            ),
            ({"max_tokens": 4, "messages": user, "model": "claude-opus-4"}, 404, "claude-opus-4"),
            ({"max_tokens": 4, "messages": user, "extra_body": {"temperature": -1}}, 400, "temperature"),
            (
                {
                    "max_tokens": 4,
                    "messages": user,
                    "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
                },
                400,
                "output_config",
            ),
            ({"max_tokens": 4, "messages": user, "stop_sequences": ["x"] * 17}, 400, "stop_sequences"),
        ):
            body = {"model": MODEL} | body
            extra = body.pop("extra_body", {})
            with pytest.raises(anthropic.APIStatusError) as e:
                client.post("/v1/messages", body=body | extra, cast_to=object)
            assert e.value.status_code == status, body
            kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
            assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind
            assert needle in e.value.body["error"]["message"], e.value.body
        with pytest.raises(anthropic.NotFoundError):
            client.messages.count_tokens(model="claude-opus-4", messages=user)
        rest = list(it)
        final = stream.get_final_message()
    assert rest[-1].type == "message_stop" and final.stop_reason in ("end_turn", "max_tokens") and final.content
    wait_pool_empty(server)


# ------------------------------------------------------------------------------------------ thinking
QWEN3_THINK, QWEN3_END, NL, NL2, EOS = 151667, 151668, 198, 271, 151645
LET, ME, THINK, PARIS = 10061, 752, 1744, 59604
#: after the generation prompt: <think>Let me think</think>\n\nParis<|im_end|> (tests/entrypoints/test_reasoning.py)
SCRIPT = {
    NL: QWEN3_THINK,
    QWEN3_THINK: LET,
    LET: ME,
    ME: THINK,
    THINK: QWEN3_END,
    QWEN3_END: NL2,
    NL2: PARIS,
    PARIS: EOS,
}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    m = write_scripted_model(tmp_path_factory.mktemp("qwen3") / "m", tokenizer_dir("qwen3"), SCRIPT)
    config = EngineConfig(model=str(m), device="cpu", num_kv_blocks=64, max_model_len=256, reasoning_parser="qwen3")
    with served(config) as srv:
        yield srv


def test_thinking_blocks_with_a_reasoning_parser(thinking_server):
    client = anthropic_client(thinking_server)
    kw = dict(model=thinking_server.state.model_name, max_tokens=16, messages=[{"role": "user", "content": FRANCE}])
    r = client.messages.create(**kw, extra_body=GREEDY)
    thinking, text = r.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", "Let me think", "text", "\n\nParis")
    assert thinking.signature and r.stop_reason == "end_turn"
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "signature", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "thinking", "signature", "text"}) for b in r.content
    ]
    assert kinds.index("signature_delta") > kinds.index("thinking_delta") and kinds[-1] == "text_delta"
    # the thinking sent back is dropped (as chat templates drop it); disabled thinking: no thinking block
    back = [
        *kw["messages"],
        {"role": "assistant", "content": [thinking.model_dump(), {"type": "text", "text": "Paris"}]},
    ]
    follow = client.messages.create(
        **(kw | {"messages": [*back, {"role": "user", "content": FRANCE}]}), extra_body=GREEDY
    )
    assert follow.content[0].type == "thinking"
    off = client.messages.create(**kw, thinking={"type": "disabled"}, extra_body=GREEDY)
    assert [(b.type, b.text) for b in off.content] == [("text", "Paris")]
    wait_pool_empty(thinking_server)


# ------------------------------------------------------------------------------------------ keys
def test_api_key_by_x_api_key_or_bearer_and_errors_in_anthropic_shape():
    """With ``--api-key``: the key by ``x-api-key`` (the SDK's ``api_key``) or ``Authorization: Bearer``
    (its ``auth_token``) passes, none or a wrong one is a 401 ``authentication_error``; while the model
    loads, ``/v1/messages`` answers 529 ``overloaded_error`` (the OpenAI routes keep their 503 and shape)."""
    release = threading.Event()

    def loader():
        release.wait(30)
        raise RuntimeError("no model in this test")

    srv = ServerThread(
        create_app(EngineConfig(model="/nonexistent/TinyModel"), loader=loader, api_key="sekret")
    ).start()
    try:
        user = [{"role": "user", "content": "Hi"}]
        for kw in (dict(api_key="nope"), dict(api_key=None, auth_token="nope")):
            with pytest.raises(anthropic.AuthenticationError) as e:
                anthropic_client(srv, **kw).messages.create(model="TinyModel", max_tokens=4, messages=user)
            assert e.value.body == {
                "type": "error",
                "error": {
                    "type": "authentication_error",
                    "message": "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                },
            }
        for kw in (dict(api_key="sekret"), dict(api_key=None, auth_token="sekret")):
            with pytest.raises(anthropic.APIStatusError) as e:
                anthropic_client(srv, **kw).messages.create(model="TinyModel", max_tokens=4, messages=user)
            assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
            assert "loading" in e.value.body["error"]["message"]

        async def openai_route():
            key = {"x-api-key": "sekret"}
            async with aiohttp.ClientSession() as s:
                async with s.get(srv.url + "/v1/models", headers=key) as r:
                    models = r.status
                async with s.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=key) as r:
                    return models, r.status, await r.json()

        models, status, body = run(openai_route())
        assert models == 200 and status == 503 and body["error"]["type"] == "service_unavailable_error"
    finally:
        release.set()
    srv._thread.join(30)
    assert not srv._thread.is_alive()
