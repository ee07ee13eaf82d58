"""The playground's server side on a small random model: ``GET /`` and its files (public under
``--api-key``), ``GET /v1/debug/kv_cache`` (behind the key, bad parameters answered 400), the websocket's
``auth`` message, and ``subscribe_kv_cache``: a snapshot then deltas that, applied in order, show the
``n=4`` choices sharing the prompt's blocks and splitting, equal the server's own snapshot, and end with
no block referenced."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio

import aiohttp

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.http.playground import CONTENT_SECURITY_POLICY
from rawpaged.entrypoints.websocket import serving as websocket
from tests.entrypoints.server_thread import run, served

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(10, 50))  # 40 tokens: blocks 0-1 full, block 2 partly filled


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=96, max_model_len=1024)
    with served(config, api_key=KEY, max_tokens_limit=512) as srv:
        yield srv


async def fetch(session, url, **kw):
    async with session.get(url, **kw) as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, r.headers, body


def test_page_is_public_and_the_snapshot_is_not(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            return {
                "page": await fetch(s, server.url + "/"),
                "js": await fetch(s, server.url + "/static/playground.js"),
                "css": await fetch(s, server.url + "/static/playground.css"),
                "missing": await fetch(s, server.url + "/static/nope.js"),
                "kv_no_key": await fetch(s, server.url + "/v1/debug/kv_cache"),
                "kv": await fetch(s, server.url + "/v1/debug/kv_cache", headers=AUTH),
                "range": await fetch(s, server.url + "/v1/debug/kv_cache?start=90&count=50", headers=AUTH),
                "bad_int": await fetch(s, server.url + "/v1/debug/kv_cache?start=x", headers=AUTH),
                "bad_start": await fetch(s, server.url + "/v1/debug/kv_cache?start=96", headers=AUTH),
                "bad_count": await fetch(s, server.url + "/v1/debug/kv_cache?count=0", headers=AUTH),
                "bad_replica": await fetch(s, server.url + "/v1/debug/kv_cache?replica=1", headers=AUTH),
                "bad_since": await fetch(s, server.url + "/v1/debug/kv_cache?since_event=-3", headers=AUTH),
            }

    out = run(main())
    status, headers, body = out["page"]
    assert status == 200 and headers["Content-Type"].startswith("text/html") and "/static/playground.js" in body
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert out["js"][0] == 200 and "subscribe_kv_cache" in out["js"][2] and out["css"][0] == 200
    assert out["missing"][0] == 404
    status, _, body = out["kv_no_key"]
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, _, snap = out["kv"]
    assert status == 200 and (snap["num_blocks"], snap["count"], snap["block_size"]) == (96, 96, 16)
    assert [b["block_id"] for b in snap["blocks"]] == list(range(96))
    assert set(snap["blocks"][0]) == {"block_id", "ref_count", "owners", "cached", "group"}
    assert {"requests", "events", "next_event_id", "num_free_blocks", "step"} <= set(snap)
    assert [b["block_id"] for b in out["range"][2]["blocks"]] == list(range(90, 96))
    bad = (("bad_int", "start"), ("bad_start", "start"), ("bad_count", "count"), ("bad_replica", "replica"))
    bad += (("bad_since", "since_event"),)
    for name, param in bad:
        status, _, body = out[name]
        assert status == 400 and body["error"]["param"] == param, (name, body)


async def _close_code(ws):
    msg = await ws.receive(timeout=30)
    while msg.type == aiohttp.WSMsgType.TEXT:
        msg = await ws.receive(timeout=30)
    return ws.close_code


def test_websocket_authenticates_by_header_or_first_message(server, monkeypatch):
    monkeypatch.setattr(websocket, "AUTH_TIMEOUT_S", 0.5)
    generate = {"type": "generate", "id": "q", "prompt": "hi", "max_tokens": 2}

    async def main():
        out = {}
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:  # no header, no auth message
                await ws.send_json(generate)
                out["no_auth"] = await ws.receive_json(timeout=30)
                out["no_auth_close"] = await _close_code(ws)
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": "wrong"})
                out["wrong"] = await ws.receive_json(timeout=30)
                out["wrong_close"] = await _close_code(ws)
            async with s.ws_connect(server.url + "/v1/ws") as ws:  # silent: closed after AUTH_TIMEOUT_S
                out["silent"] = await ws.receive_json(timeout=30)
                out["silent_close"] = await _close_code(ws)
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": KEY})
                out["ok"] = await ws.receive_json(timeout=30)
                await asyncio.sleep(0.7)  # past the timeout: an authenticated socket stays open
                await ws.send_json(generate)
                out["ok_first"] = await ws.receive_json(timeout=30)
                await ws.send_json({"type": "auth", "api_key": KEY})
                while (msg := await ws.receive_json(timeout=30))["type"] != "error":
                    pass
                out["twice"] = msg
            async with s.ws_connect(server.url + "/v1/ws", headers=AUTH) as ws:
                await ws.send_json(generate)
                out["header"] = await ws.receive_json(timeout=30)
            try:
                async with s.ws_connect(server.url + "/v1/ws", headers={"Authorization": "Bearer wrong"}):
                    out["bad_header"] = "open"
            except aiohttp.WSServerHandshakeError as e:
                out["bad_header"] = e.status
        return out

    out = run(main())
    for name in ("no_auth", "wrong", "silent"):
        assert out[name]["type"] == "error" and out[name]["status"] == 401, out[name]
        assert out[f"{name}_close"] == websocket.CLOSE_UNAUTHORIZED
    assert out["ok"] == {"type": "auth_ok"}
    assert out["ok_first"]["type"] == "delta" and out["ok_first"]["request_id"].startswith("ws-")
    assert out["twice"]["param"] == "type" and out["twice"]["status"] == 400
    assert out["header"]["type"] == "delta"
    assert out["bad_header"] == 401


def apply(state: dict, msg: dict) -> None:
    """What the page does with a ``kv_cache`` or ``kv_cache_delta`` message."""
    if msg["type"] == "kv_cache":
        state["blocks"] = {b["block_id"]: b for b in msg["blocks"]}
    else:
        for b in msg["blocks"]:
            state["blocks"][b["block_id"]] = b
    if "requests" in msg:
        state["requests"] = msg["requests"]
    state["events"] += msg["events"]


def test_subscription_shows_n4_sharing_then_every_block_returned(server):
    async def main():
        looks, state = [], {"events": []}
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_json({"type": "subscribe_kv_cache", "id": "kv", "interval_ms": 50})
                first = await ws.receive_json(timeout=30)
                assert first["type"] == "kv_cache", first
                apply(state, first)
                await ws.send_json(
                    {
                        "type": "generate",
                        "id": "g",
                        "prompt": PROMPT,
                        "n": 4,
                        "temperature": 1.0,
                        "seed": 3,
                        "max_tokens": 400,
                        "ignore_eos": True,
                    }
                )
                done, rid = 0, None
                while done < 4:
                    msg = await ws.receive_json(timeout=60)
                    if msg["type"] in ("kv_cache", "kv_cache_delta"):
                        assert msg["id"] == "kv"
                        apply(state, msg)
                        looks.append({i: (b["ref_count"], tuple(b["owners"])) for i, b in state["blocks"].items()})
                    elif msg["type"] == "done":
                        done += 1
                        rid = msg["request_id"]
                    else:
                        assert msg["type"] == "delta", msg
                # the pool after the request: deltas keep coming until the subscription saw it idle
                deadline = asyncio.get_running_loop().time() + 10
                while any(b["ref_count"] for b in state["blocks"].values()):
                    assert asyncio.get_running_loop().time() < deadline, "blocks still referenced"
                    apply(state, await ws.receive_json(timeout=10))
                # the subscription may lag a fresh look by one interval (a freed block's ``cached`` flag
                # changes after its ref_count): read deltas until both agree, or fail at the deadline
                while True:
                    async with s.get(server.url + "/v1/debug/kv_cache") as r:
                        fresh = await r.json()
                    if state["blocks"] == {b["block_id"]: b for b in fresh["blocks"]}:
                        break
                    assert asyncio.get_running_loop().time() < deadline, "deltas never caught up with the pool"
                    try:
                        apply(state, await ws.receive_json(timeout=0.5))
                    except asyncio.TimeoutError:
                        pass
                await ws.send_json({"type": "cancel", "id": "kv"})
        return looks, state, rid, fresh

    looks, state, rid, fresh = run(main())
    shared = [look for look in looks if any(ref == 4 and owners == (rid,) for ref, owners in look.values())]
    assert shared, "no look showed the prompt's blocks shared by the four choices"
    split = [look for look in looks if sum(1 for ref, owners in look.values() if owners == (rid,)) > 3]
    assert split, "no look showed the choices' own blocks"
    events = [e for e in state["events"] if e["request_id"] == rid]
    assert sorted(e["index"] for e in events if e["type"] == "fork") == [1, 2, 3]
    copies = [e for e in events if e["type"] == "copy"]
    # the prompt's partly filled third block, copied by the first three choices to write into it
    assert len(copies) == 3 and len({e["src"] for e in copies}) == 1
    assert len({e["dst"] for e in copies} | {copies[0]["src"]}) == 4
    assert [e["event_id"] for e in state["events"]] == sorted({e["event_id"] for e in state["events"]})  # once each
    assert state["blocks"] == {b["block_id"]: b for b in fresh["blocks"]}  # deltas rebuilt the pool exactly
    assert all(b["ref_count"] == 0 and b["owners"] == [] for b in fresh["blocks"]) and fresh["requests"] == []
    assert sum(b["cached"] for b in fresh["blocks"]) >= 2  # the prompt's full blocks stay cached, free


def test_subscription_errors(server):
    async def main():
        out = []
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.ws_connect(server.url + "/v1/ws") as ws:
                for msg in (
                    {"type": "subscribe_kv_cache", "id": "a", "interval_ms": 1},
                    {"type": "subscribe_kv_cache", "id": "b", "start": 500},
                    {"type": "subscribe_kv_cache", "id": "c", "replica": 3},
                    {"type": "subscribe_kv_cache", "id": "d", "extra": 1},
                    {"type": "subscribe_kv_cache", "id": "e", "replica": True},  # not a number
                ):
                    await ws.send_json(msg)
                    out.append(await ws.receive_json(timeout=30))
        return out

    out = run(main())
    assert [(m["type"], m["id"], m["param"], m["status"]) for m in out] == [
        ("error", "a", "interval_ms", 400),
        ("error", "b", "start", 400),
        ("error", "c", "replica", 400),
        ("error", "d", "extra", 400),
        ("error", "e", "replica", 400),
    ]
