"""The Responses API (``POST /v1/responses``) driven by the real ``openai`` client on the default model: a
plain turn, a streamed turn rebuilt by the SDK's stream helper, a tool round trip, a chained turn by
``previous_response_id``, ``text.format`` json_schema, retrieval and ``store``, and bad input in OpenAI's
error shape."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("openai")

import json

import openai

from rawpaged.config import EngineConfig
from tests.entrypoints.server_thread import openai_client, served, wait_pool_empty

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=128, max_model_len=1024)
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=120)


def test_a_plain_turn(server, client):
    r = client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=16, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert "Paris" in r.output_text
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = client.responses.create(model=MODEL, input="Count from one to fifty.", max_output_tokens=4, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    wait_pool_empty(server)


def test_a_streamed_turn_rebuilt_by_the_sdk(server, client):
    plain = client.responses.create(
        model=MODEL, input=FRANCE, max_output_tokens=16, temperature=0, instructions="Be brief."
    )
    with client.responses.stream(
        model=MODEL, input=FRANCE, max_output_tokens=16, temperature=0, instructions="Be brief."
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):  # fmt: skip
        assert kind in kinds, kind
    wait_pool_empty(server)


def test_a_tool_round_trip_and_a_chained_turn(server, client):
    """A forced call with valid arguments, its output sent back by previous_response_id, and an answer;
    the chained request carried the earlier conversation (its prompt holds more tokens than its input)."""
    first = client.responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and first.status == "completed"
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER_TOOL],
        max_output_tokens=32,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt
    third = client.responses.create(
        model=MODEL, previous_response_id=second.id, input="Thanks! And in Rome?", max_output_tokens=8, temperature=0
    )
    alone = client.responses.create(model=MODEL, input="Thanks! And in Rome?", max_output_tokens=8, temperature=0)
    assert third.usage.input_tokens > alone.usage.input_tokens + 20  # the whole exchange came before it
    wait_pool_empty(server)


def test_json_schema_text_format(server, client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    r = client.responses.create(
        model=MODEL,
        input=FRANCE,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=30,
        temperature=0,
    )
    assert set(json.loads(r.output_text)) == {"city"}


def test_retrieval_store_and_errors(server, client):
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    for kwargs, param in (
        (dict(input="Hi", temperature=-1), "temperature"),
        (dict(input="Hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input=[]), "input"),
        (dict(input=[{"type": "image", "url": "x"}]), "input"),
        (dict(input="Hi", text={"format": {"type": "xml"}}), "text"),
        (
            dict(input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}),
            "text",
        ),
        (dict(input="Hi " * 2000), "input"),  # longer than the context
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
        assert e.value.body["message"].startswith(param) or param == "input", e.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-17", input="Hi")
    wait_pool_empty(server)


def test_output_text_logprobs_with_include_and_top_logprobs(server, client):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` gives the message's tokens'
    logprobs, plain and streamed, equal to chat's for the same conversation (vLLM's semantics); without the
    include there are none."""
    kw = dict(model=MODEL, input=FRANCE, max_output_tokens=8, temperature=0)
    r = client.responses.create(**kw, top_logprobs=3, include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": FRANCE}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    part = r.output[0].content[0]
    want = chat.choices[0].logprobs.content
    assert len(part.logprobs) == len(want) == r.usage.output_tokens
    for got, ref in zip(part.logprobs, want):
        assert got.token == ref.token and got.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t.token for t in ref.top_logprobs]
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text)  # then EOS, as chat's
    assert r.top_logprobs == 3
    with client.responses.stream(**kw, top_logprobs=3, include=["message.output_text.logprobs"]) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    streamed = [lp.token for d in deltas for lp in d.logprobs]  # EOS has no text, so no delta: in .done
    assert streamed == [lp.token for lp in part.logprobs][: len(streamed)] and len(streamed) >= len(part.logprobs) - 1
    assert [lp.token for lp in final.output[0].content[0].logprobs] == [lp.token for lp in part.logprobs]
    plain = client.responses.create(**kw, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == []
    for bad, param in ((dict(include=["everything"]), "include"), (dict(top_logprobs=21), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**kw, **bad)
        assert e.value.body["param"] == param
    wait_pool_empty(server)


def test_tools_are_echoed_with_strict_and_parameters(server, client):
    tools = [WEATHER_TOOL, dict(WEATHER_TOOL, name="get_time", strict=True)]
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0, tools=tools)
    echoed = r.model_dump()["tools"]
    assert [t["strict"] for t in echoed] == [None, True]
    assert all(t["parameters"] == WEATHER_TOOL["parameters"] for t in echoed)
    wait_pool_empty(server)


def _poll(client, rid, statuses, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status in statuses or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_background_responses_run_after_the_answer_and_can_be_cancelled(server, client):
    kw = dict(model=MODEL, input=FRANCE, max_output_tokens=16, temperature=0)
    plain = client.responses.create(**kw)
    queued = client.responses.create(**kw, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _poll(client, queued.id, ("completed", "incomplete", "failed"))
    assert done.status == "completed" and done.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as e:  # finished: nothing to cancel
        client.responses.cancel(queued.id)
    assert "Cannot cancel" in e.value.body["message"]
    long = client.responses.create(
        model=MODEL, input="Count from one to a thousand.", max_output_tokens=900, temperature=0, background=True
    )
    running = _poll(client, long.id, ("in_progress", "completed", "incomplete"))
    assert running.status == "in_progress"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    wait_pool_empty(server)  # the cancelled request's blocks are back
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw, background=True, store=False)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    sync = client.responses.create(**kw)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(sync.id)
