"""The server against clients that misbehave: idle, half-header and half-body sockets are timed out; past
the connection limit a new connection is refused at once while ``/health`` answers; past the queue limit a
request gets 503 with Retry-After; ``Expect: 100-continue`` with too large a body gets 413; a Host that is
not this machine gets 403; unknown fields are logged or refused; websocket ids keep their JSON type, lone
surrogates and oversize messages get an ``error`` frame, idle sockets are closed. Each test fails without
its fix (docs/server.md, "Timeouts and limits")."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json
import logging
import socket
import time

import aiohttp

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.generation.reply_writer import dumps_by_part
from rawpaged.entrypoints.server.config import ServerConfig
from tests.entrypoints.server_thread import run, served, wait_pool_empty

MAX_CONNECTIONS = 12
MAX_BODY = 64 * 1024
LIMITS = ServerConfig(
    timeout_keep_alive=1.0,
    timeout_body=1.0,
    max_connections=MAX_CONNECTIONS,
    max_queued_requests=1,
    ws_ping_interval=30.0,
    ws_idle_timeout=1.5,
)


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=128, max_num_seqs=2)
    with served(config, max_body_size=MAX_BODY, server_config=LIMITS) as srv:
        yield srv


def raw(port: int, payload: bytes = b"", timeout: float = 10.0) -> tuple:
    """Send ``payload`` on a new socket and read until the server closes it: (bytes read, seconds until
    closed); seconds is None when it was still open after ``timeout``."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    start = time.monotonic()
    data = b""
    try:
        if payload:
            s.sendall(payload)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data, time.monotonic() - start
            data += chunk
    except TimeoutError:
        return data, None
    except ConnectionResetError:
        return data, time.monotonic() - start
    finally:
        s.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0


def wait_connections(srv, at_most: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.state.gate.num_open() > at_most:
        assert time.monotonic() < deadline, srv.state.gate.num_open()
        time.sleep(0.05)


HEALTH = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


def post_head(length: int, extra: str = "") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def test_idle_half_header_and_half_body_sockets_are_closed(server):
    cases = {
        "silent": b"",
        "idle after a response": HEALTH,
        "half a header": b"GET /health HTTP/1.1\r\nHost: loc",
        "half a body": post_head(len(BODY)) + BODY[:5],
    }

    async def main():
        return await asyncio.gather(*(asyncio.to_thread(raw, server.port, p) for p in cases.values()))

    results = dict(zip(cases, run(main())))
    for name, (_data, closed_after) in results.items():
        assert closed_after is not None, f"{name}: still open"
        # keep-alive 1 s; a body 1 s, then at most 1 s of lingering
        assert closed_after < 4.0, (name, closed_after)
    assert status_of(results["idle after a response"][0]) == 200
    assert status_of(results["half a body"][0]) == 408
    assert b"--timeout-body" in results["half a body"][0]
    wait_connections(server, 0)


def test_past_the_connection_limit_health_answers_and_others_get_a_fast_503(tiny_dir):
    # its own server, with a body timeout the slow bodies below cannot reach on a loaded host
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    limits = ServerConfig(timeout_body=60.0, max_connections=MAX_CONNECTIONS)
    busy = []
    with served(config, server_config=limits) as srv:
        try:
            for _ in range(MAX_CONNECTIONS):  # each sent its headers and is sending its body slowly
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.sendall(post_head(len(BODY)) + BODY[:3])
                busy.append(s)
            deadline = time.monotonic() + 10
            while srv.state.gate.num_busy() < MAX_CONNECTIONS:  # open is not enough: an idle one is evicted
                assert time.monotonic() < deadline, (srv.state.gate.num_open(), srv.state.gate.num_busy())
                time.sleep(0.02)
            start = time.monotonic()
            health, _ = raw(srv.port, HEALTH, timeout=5)
            other, _ = raw(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", timeout=5)
            took = time.monotonic() - start
            num_refused = srv.state.gate.num_refused
        finally:
            for s in busy:
                s.close()
    assert status_of(health) == 200, health
    assert json.loads(health.split(b"\r\n\r\n", 1)[1])["status"] == "ok"
    assert status_of(other) == 503 and b"Retry-After: 1" in other, other
    assert took < 2.0
    assert num_refused >= 2


def test_idle_sockets_past_the_limit_make_way_for_new_ones(server):
    idle = []
    try:
        for _ in range(3 * MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
            time.sleep(0.01)  # accepted one by one (a burst accepted at once is refused past the limit)
        time.sleep(0.2)
        assert server.state.gate.num_open() <= MAX_CONNECTIONS
        status, _ = asyncio.run(_get(server.url + "/v1/models"))
        assert status == 200
    finally:
        for s in idle:
            s.close()
    assert server.state.gate.num_evicted >= 2 * MAX_CONNECTIONS
    wait_connections(server, 0)


async def _get(url, **kw):
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r.status, await r.json()


def test_expect_100_continue_with_too_large_a_body_is_a_413_before_the_body(server):
    data, closed_after = raw(server.port, post_head(MAX_BODY + 1, "Expect: 100-continue\r\n"), timeout=5)
    assert status_of(data) == 413, data
    assert b"100 Continue" not in data
    assert closed_after is not None
    ok, _ = raw(server.port, post_head(len(BODY), "Expect: 100-continue\r\nConnection: close\r\n"), timeout=2)
    assert ok.startswith(b"HTTP/1.1 100 Continue"), ok  # a body within the limit is asked for


def test_a_host_that_is_not_this_machine_is_refused(server):
    # DNS rebinding: evil.example resolves to 127.0.0.1; the browser calls it same-origin
    evil, _ = raw(server.port, b"GET /v1/models HTTP/1.1\r\nHost: evil.example:8000\r\nConnection: close\r\n\r\n")
    assert status_of(evil) == 403 and b"--allowed-hosts" in evil, evil
    for host in (b"localhost", b"127.0.0.1:8000", b"[::1]:8000", b"api.localhost"):
        ok, _ = raw(server.port, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
        assert status_of(ok) == 200, (host, ok)


def test_allowed_hosts_are_answered(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    with served(config, server_config=ServerConfig(allowed_hosts=("My.Box",))) as srv:
        ok, _ = raw(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: my.box:8000\r\nConnection: close\r\n\r\n")
        other, _ = raw(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: other.box\r\nConnection: close\r\n\r\n")
    assert status_of(ok) == 200 and status_of(other) == 403


def test_past_the_queue_limit_requests_get_503_with_retry_after(server):
    # max_num_seqs 2 running + max_queued_requests 1: the fourth request in flight is refused
    url = server.url + "/v1/completions"
    body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            held = [await s.post(url, json=body) for _ in range(3)]
            try:
                assert [r.status for r in held] == [200, 200, 200]
                async with s.post(url, json={**body, "stream": False}) as r:
                    refused = r.status, r.headers.get("Retry-After"), await r.json()
            finally:
                for r in held:
                    r.close()
            return refused

    status, retry_after, body = run(main())
    assert status == 503 and retry_after == "1", body
    assert body["error"]["type"] == "service_unavailable_error"
    assert "--max-queued-requests" in body["error"]["message"]
    wait_pool_empty(server)


def test_unknown_fields_are_logged_or_refused(server, tiny_dir, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "temprature": 0.2}
    with caplog.at_level(logging.WARNING, logger="rawpaged.server"):
        status, _ = run(_post(server.url + "/v1/completions", body))
    assert status == 200
    assert any("'temprature'" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)

    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    with served(config, server_config=ServerConfig(reject_unknown_fields=True)) as srv:
        status, refused = run(_post(srv.url + "/v1/completions", body))
        ws_reply = run(_ws_exchange(srv.url, [{"type": "generate", "id": 1, **body}], 1))[0]
    assert status == 400 and refused["error"]["param"] == "temprature", refused
    assert ws_reply["type"] == "error" and ws_reply["param"] == "temprature" and ws_reply["id"] == 1


async def _post(url, body):
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def _ws_exchange(url, messages, num_replies, raw_messages=()):
    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/ws") as ws:
        for m in messages:
            await ws.send_str(json.dumps(m))
        for m in raw_messages:
            await ws.send_str(m)
        return [json.loads((await ws.receive(timeout=30)).data) for _ in range(num_replies)]


def test_websocket_ids_keep_their_json_type(server):
    gen = {"type": "generate", "prompt": "hi", "max_tokens": 2}
    replies = run(_ws_exchange(server.url, [{**gen, "id": 12345}, {**gen, "id": "12345"}], 2 * 3))
    done = [r for r in replies if r["type"] == "done"]
    assert sorted(map(repr, (r["id"] for r in done))) == ["'12345'", "12345"], replies


def test_websocket_lone_surrogate_and_oversize_message_get_error_frames(server):
    surrogate = '{"type": "generate", "id": "abc", "prompt": "abc \\ud800", "max_tokens": 2}'
    unreadable_id = '{"type": "generate", "id": "\\udc00", "prompt": "abc", "max_tokens": 2}'
    oversize = json.dumps({"type": "generate", "id": "big", "prompt": "x" * (MAX_BODY + 10)})
    after = {"type": "generate", "id": "after", "prompt": "hi", "max_tokens": 1}

    async def main():
        async with aiohttp.ClientSession() as s, s.ws_connect(server.url + "/v1/ws") as ws:
            await ws.send_str(surrogate)
            first = json.loads((await ws.receive(timeout=10)).data)
            await ws.send_str(unreadable_id)
            no_id = json.loads((await ws.receive(timeout=10)).data)
            await ws.send_str(oversize)
            second = json.loads((await ws.receive(timeout=10)).data)
            await ws.send_str(json.dumps(after))  # the socket still works
            rest = [json.loads((await ws.receive(timeout=30)).data) for _ in range(2)]
            return first, no_id, second, rest

    first, no_id, second, rest = run(main())
    assert first["type"] == "error" and first["status"] == 400 and "surrogate" in first["message"], first
    assert first["id"] == "abc", first  # a client that multiplexes knows which request failed
    assert no_id["type"] == "error" and no_id["id"] is None and "surrogate" in no_id["message"], no_id
    assert second["type"] == "error" and second["status"] == 413 and "--max-body-size" in second["message"]
    assert [r["type"] for r in rest] == ["delta", "done"] or rest[-1]["type"] == "done", rest


def test_idle_websocket_is_closed_but_not_while_a_request_runs(server):
    async def main():
        async with aiohttp.ClientSession() as s, s.ws_connect(server.url + "/v1/ws") as ws:
            start = time.monotonic()
            msg = await ws.receive(timeout=10)
            error = json.loads(msg.data)
            closing = await ws.receive(timeout=5)
            return error, closing, time.monotonic() - start

    error, closing, took = run(main())
    assert error["status"] == 408 and "--ws-idle-timeout" in error["message"]
    assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 4408
    assert 1.0 < took < 4.0


def test_refused_requests_are_logged_and_404s_are_json(server, caplog):
    with caplog.at_level(logging.INFO, logger="rawpaged.server"):
        missing = run(_get(server.url + "/static/missing.js"))
        wrong_model = run(_post(server.url + "/v1/completions", {"prompt": "hi", "model": "gpt-4"}))
    assert missing[0] == 404 and missing[1]["error"]["type"] == "not_found_error"
    assert wrong_model[0] == 404 and server.state.model_name in wrong_model[1]["error"]["message"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("/static/missing.js -> 404" in m for m in lines), lines
    assert any("/v1/completions -> 404" in m and "gpt-4" in m for m in lines), lines


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server, monkeypatch):
    tok = server.state.engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(text) or [1])
    prompt = "x" * (tok.max_token_chars * 128 + 1)  # max_model_len 128
    status, body = run(_post(server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1}))
    assert status == 400 and "characters are at least" in body["error"]["message"], body
    assert calls == []


def test_large_responses_are_encoded_by_part_to_the_same_json():
    obj = {"id": "x", "choices": [{"index": i, "text": 'é\u2028"', "lp": [0.1] * 3} for i in range(3)], "usage": {}}
    assert dumps_by_part(obj, "choices") == json.dumps(obj)
    assert json.loads(dumps_by_part({"choices": []}, "choices")) == {"choices": []}


def test_a_websocket_that_does_not_answer_pings_is_closed(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)

    async def frames(autoping: bool, seconds: float) -> tuple:
        """The frame types the client sees for ``seconds``, and whether the socket was closed then."""
        seen = []
        async with aiohttp.ClientSession() as s, s.ws_connect(srv.url + "/v1/ws", autoping=autoping) as ws:
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                try:  # not receive(timeout=): an answered ping restarts that clock
                    msg = await asyncio.wait_for(ws.receive(), left)
                except asyncio.TimeoutError:
                    break
                seen.append(msg.type)
                if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break
            return seen, ws.closed

    with served(config, server_config=ServerConfig(ws_ping_interval=0.4)) as srv:
        silent, silent_closed = run(asyncio.wait_for(frames(autoping=False, seconds=5.0), 15))
        polite, polite_closed = run(asyncio.wait_for(frames(autoping=True, seconds=2.0), 15))
    assert silent[0] == aiohttp.WSMsgType.PING and silent_closed, silent  # pinged, no pong, closed
    assert not polite_closed and aiohttp.WSMsgType.CLOSE not in polite, polite  # answered pings: kept open
