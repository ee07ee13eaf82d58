"""The server on a small random model (fast, no download): streamed choices one per chunk, CORS, 405s
that keep ``Allow``, websocket ids and logprobs shapes, beam search with logprobs, a failing request
answered alone, and logprobs whose tokens share text."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json
import logging

import aiohttp

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.generation.output_json import chat_logprobs, completion_logprobs, token_text
from tests.entrypoints.server_thread import ServerThread, run, served, sse, wait_pool_empty

ORIGIN = "https://ok.example"


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=128, max_model_len=256)
    with served(config, max_tokens_limit=64, allowed_origins=[ORIGIN]) as srv:
        yield srv


async def post(session, url, body, **kw):
    async with session.post(url, json=body, **kw) as r:
        return r.status, dict(r.headers), await r.json()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "abc", "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 1, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "n": 3,
                "temperature": 1.0,
                "seed": 1,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
    ],
)
def test_streams_send_one_choice_per_chunk(tiny_server, path, body):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await sse(s, tiny_server.url + path, body)

    chunks, done = run(main())
    assert done and all(len(c["choices"]) == 1 for c in chunks)
    per_index = {}
    for c in chunks:
        per_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(per_index) == [0, 1, 2]
    for choices in per_index.values():
        finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
        assert finishes == ["length"] and choices[-1]["finish_reason"] == "length"
        if "chat" in path:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}  # each choice's own role chunk
            assert all(c["logprobs"] for c in choices[1:-1]) and choices[-1]["delta"] == {}
    wait_pool_empty(tiny_server)


def test_cors_preflight_headers_and_methods(tiny_server):
    async def main():
        async with aiohttp.ClientSession() as s:
            out = {}
            pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
            for name, origin in (("ok", ORIGIN), ("other", "https://evil.example")):
                async with s.options(tiny_server.url + "/v1/completions", headers={"Origin": origin, **pre}) as r:
                    out[f"preflight_{name}"] = (r.status, dict(r.headers))
                async with s.get(tiny_server.url + "/v1/models", headers={"Origin": origin}) as r:
                    out[f"get_{name}"] = (r.status, dict(r.headers))
            body = {"prompt": "a", "max_tokens": 2, "stream": True}
            async with s.post(tiny_server.url + "/v1/completions", json=body, headers={"Origin": ORIGIN}) as r:
                await r.read()
                out["stream"] = (r.status, dict(r.headers))
            async with s.get(tiny_server.url + "/v1/completions") as r:
                out["get_post_route"] = (r.status, dict(r.headers), await r.json())
            evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
            async with s.post(tiny_server.url + "/v1/completions", data='{"prompt": "a"}', headers=evil) as r:
                out["simple_post_other"] = (r.status, await r.json())
            same = {"Origin": tiny_server.url}
            async with s.get(tiny_server.url + "/v1/models", headers=same) as r:
                out["same_origin"] = (r.status, dict(r.headers))
            for name, origin in (("ok", ORIGIN), ("other", "https://evil.example"), ("same", tiny_server.url)):
                try:
                    async with s.ws_connect(tiny_server.url + "/v1/ws", headers={"Origin": origin}) as ws:
                        await ws.send_json({"type": "generate", "id": "w", "prompt": "a", "max_tokens": 1})
                        out[f"ws_{name}"] = json.loads((await ws.receive(timeout=30)).data)["type"]
                except aiohttp.WSServerHandshakeError as e:
                    out[f"ws_{name}"] = e.status
            return out

    out = run(main())
    status, headers = out["preflight_ok"]
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert (
        "POST" in headers["Access-Control-Allow-Methods"] and headers["Access-Control-Allow-Headers"] == "authorization"
    )
    assert "Access-Control-Allow-Origin" not in out["preflight_other"][1] and out["preflight_other"][0] == 403
    assert out["get_ok"][1]["Access-Control-Allow-Origin"] == ORIGIN and out["get_ok"][1]["Vary"] == "Origin"
    assert out["get_other"][0] == 403 and "Access-Control-Allow-Origin" not in out["get_other"][1]
    status, body = out["simple_post_other"]  # a browser sends it without a preflight: refused before it runs
    assert status == 403 and body["error"]["type"] == "permission_error"
    assert out["same_origin"][0] == 200 and "Access-Control-Allow-Origin" not in out["same_origin"][1]
    assert out["ws_ok"] == "delta" and out["ws_same"] == "delta" and out["ws_other"] == 403
    assert out["stream"][0] == 200 and out["stream"][1]["Access-Control-Allow-Origin"] == ORIGIN  # streams too
    status, headers, body = out["get_post_route"]
    assert status == 405 and headers["Allow"] == "POST" and body["error"]["type"] == "invalid_request_error"


def test_no_cors_headers_unless_asked(tiny_dir):
    srv = ServerThread(
        create_app(EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64))
    ).start()
    try:
        srv.wait_healthy()

        async def main():
            async with aiohttp.ClientSession() as s:
                out = []
                for headers in ({}, {"Origin": srv.url}, {"Origin": ORIGIN}):
                    async with s.get(srv.url + "/v1/models", headers=headers) as r:
                        out.append((r.status, dict(r.headers)))
                return out

        (plain, plain_h), (same, same_h), (other, _) = run(main())
        assert plain == same == 200 and other == 403  # no browser page of another origin by default
        assert not any(k.startswith("Access-Control") or k == "Vary" for k in {**plain_h, **same_h})
    finally:
        assert srv.stop() == 0


def test_websocket_ids_logprobs_shapes_and_log_label(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="rawpaged.server")

    async def main():
        async with aiohttp.ClientSession() as s, s.ws_connect(tiny_server.url + "/v1/ws") as ws:
            await ws.send_json(
                {"type": "generate", "id": "p", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "temperature": 0}
            )
            await ws.send_json({"type": "generate", "id": "p", "prompt": "again"})  # duplicate while p runs
            await ws.send_json(
                {
                    "type": "generate",
                    "id": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "logprobs": 2,
                    "temperature": 0,
                }
            )
            msgs = []
            while sum(m["type"] == "done" for m in msgs) < 2:
                msgs.append(json.loads((await ws.receive(timeout=60)).data))
            return msgs

    msgs = run(main())
    errors = [m for m in msgs if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["id"] == "p" and errors[0]["param"] == "id"
    p_lp = [m["logprobs"] for m in msgs if m["type"] == "delta" and m["id"] == "p"]
    m_lp = [m["logprobs"] for m in msgs if m["type"] == "delta" and m["id"] == "m"]
    assert p_lp and all(set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for lp in p_lp)
    assert m_lp and all(set(lp) == {"content", "refusal"} and lp["content"][0]["top_logprobs"] for lp in m_lp)
    lines = [r.getMessage() for r in caplog.records if "websocket id" in r.getMessage()]
    assert any("(websocket id 'p')" in line for line in lines) and any("(websocket id 'm')" in line for line in lines)
    wait_pool_empty(tiny_server)


def test_beam_search_with_logprobs_returns_one_entry_per_token(tiny_server):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await post(
                s,
                tiny_server.url + "/v1/completions",
                {"prompt": "abc", "max_tokens": 6, "n": 2, "use_beam_search": True, "logprobs": 3, "ignore_eos": True},
            )

    status, _, body = run(main())
    assert status == 200, body
    for choice in body["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
        assert all(isinstance(v, float) for v in lp["token_logprobs"])


def test_a_request_failing_in_the_engine_gets_a_500_alone(tiny_server, monkeypatch):
    from rawpaged.engine import token_selection as llm_engine

    real = llm_engine.draw_uniform

    def draw(params, rng):
        if params.seed == 666:
            raise RuntimeError("poisoned")
        return real(params, rng)

    monkeypatch.setattr(llm_engine, "draw_uniform", draw)

    async def main():
        async with aiohttp.ClientSession() as s:
            good = post(s, tiny_server.url + "/v1/completions", {"prompt": "abc", "max_tokens": 8, "temperature": 0})
            bad = post(s, tiny_server.url + "/v1/completions", {"prompt": "abc", "max_tokens": 8, "seed": 666})
            return await asyncio.gather(good, bad)

    (good_status, _, good), (bad_status, _, bad) = run(main())
    assert good_status == 200 and good["choices"][0]["finish_reason"] == "length"
    assert bad_status == 500 and "poisoned" in bad["error"]["message"]
    assert bad["error"]["type"] == "internal_server_error"
    wait_pool_empty(tiny_server)
    assert tiny_server.state.engine is not None


class CollidingTokenizer:
    """Token ids 7, 8 and 9 all decode to the same text (byte pieces of one character do)."""

    def decode(self, ids, skip_special_tokens=False):
        return "X" if ids[0] in (7, 8, 9) else f"<{ids[0]}>"


def test_top_logprobs_keep_the_chosen_then_the_best_ranked_on_collisions():
    tok = CollidingTokenizer()
    # The chosen token 8 first, then the top ones by rank: 7 and 9 share its text.
    lp = completion_logprobs(tok, [8, 1], [{8: -2.0, 7: -0.5, 1: -1.0, 9: -3.0}, {1: -0.1, 9: -0.2, 7: -0.3}])
    assert lp["token_logprobs"] == [-2.0, -0.1]
    assert lp["top_logprobs"][0] == {"X": -2.0, "<1>": -1.0}  # the chosen token's own value
    assert lp["top_logprobs"][1] == {"<1>": -0.1, "X": -0.2}  # the best-ranked of 9 and 7


@pytest.mark.model
def test_repeated_emoji_logprobs_are_consistent(model_dir):
    from rawpaged import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate(["🎉🎉🎉🎉🎉🎉"], SamplingParams(temperature=0, max_tokens=8, logprobs=5))[0].outputs[0]
    lp = completion_logprobs(llm.tokenizer, out.token_ids, out.logprobs)
    for token, value, top, entry in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], out.logprobs):
        assert top[token] == value
        texts = {}
        for t, v in entry.items():
            texts.setdefault(token_text(llm.tokenizer, t), []).append(v)
        for text, values in texts.items():
            if text != token:
                assert top[text] == max(values)
    chat = chat_logprobs(llm.tokenizer, out.token_ids, out.logprobs, 5)["content"]
    rebuilt = b"".join(bytes(c["bytes"]) for c in chat).decode("utf-8", errors="replace")
    assert rebuilt == llm.tokenizer.decode(out.token_ids) and "\ufffd" in "".join(c["token"] for c in chat)


def test_chat_template_kwargs_and_generation_config_defaults(tmp_path, tiny_dir):
    """``chat_template_kwargs`` reach the template (a variable it reads changes the prompt), reserved names
    are a 400, and generation_config.json's temperature is the default where a request sets none."""
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    config = EngineConfig(model=str(d), device="cpu", num_kv_blocks=64, max_model_len=256)
    srv = ServerThread(create_app(config, max_tokens_limit=64)).start()
    srv.wait_healthy()
    url = srv.url + "/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 2, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            plain = await post(s, url, base)
            off = await post(s, url, {**base, "chat_template_kwargs": {"enable_thinking": False}})
            bad = await post(s, url, {**base, "chat_template_kwargs": {"messages": []}})
            sampled = await post(s, url, {**base, "temperature": 1.0, "seed": 3})
            return plain, off, bad, sampled

    try:
        plain, off, bad, sampled = run(main())
    finally:
        assert srv.stop() == 0
    assert plain[0] == off[0] == 200
    assert off[2]["usage"]["prompt_tokens"] == plain[2]["usage"]["prompt_tokens"] + len("<think></think>")
    assert bad[0] == 400 and bad[2]["error"]["param"] == "chat_template_kwargs"
    greedy = [c["message"]["content"] for c in plain[2]["choices"]]
    assert greedy[0] == greedy[1], "the generation config's temperature 0 applies: both choices greedy"
    drawn = [c["message"]["content"] for c in sampled[2]["choices"]]
    assert drawn[0] != drawn[1], "an explicit temperature wins over the default"


def test_a_grammar_without_llguidance_is_a_400_naming_the_package(tiny_dir, monkeypatch):
    """A host without llguidance serves everything else; a constrained request there is refused up front
    (as for any bad field), and the next request runs."""
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    srv = ServerThread(create_app(config)).start()
    srv.wait_healthy()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def main():
        async with aiohttp.ClientSession() as s:
            refused = await post(
                s, srv.url + "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}}
            )
            plain = await post(s, srv.url + "/v1/chat/completions", body)
            return refused, plain

    try:
        (status, _, err), (ok, _, _) = run(main())
        assert status == 400 and ok == 200, err
        assert (
            "needs the package 'llguidance'" in err["error"]["message"]
            and err["error"]["type"] == "invalid_request_error"
        )
        wait_pool_empty(srv)
    finally:
        assert srv.stop() == 0


def test_a_websocket_cancel_during_a_slow_compile_stops_the_request(tiny_dir, monkeypatch):
    """The cancel reaches the engine before the request does (its grammar still compiles): the request
    must never run. Also over HTTP: a client that leaves while its grammar compiles."""
    import time

    from rawpaged.structured_output.manager import StructuredOutputManager

    real = StructuredOutputManager.compile

    def slow(self, params):
        time.sleep(0.8)
        return real(self, params)

    monkeypatch.setattr(StructuredOutputManager, "compile", slow)
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    srv = ServerThread(create_app(config)).start()
    srv.wait_healthy()
    body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "structured_outputs": {"regex": "[a-z]{1,300}"}}

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(srv.url + "/v1/ws") as ws:
                await ws.send_json({"type": "generate", "id": 7, **body})
                await ws.send_json({"type": "cancel", "id": 7})
                done = await ws.receive_json(timeout=10)
                await asyncio.sleep(1.2)  # the compile ends
                running = (await (await s.get(srv.url + "/v1/debug/stats")).json())["num_requests_running"]
            try:
                await s.post(srv.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3))
            except asyncio.TimeoutError:
                pass  # the client left while its grammar compiled
            await asyncio.sleep(1.2)
            return done, running

    try:
        done, running = run(main())
        assert done["type"] == "done" and done["finish_reason"] == "abort" and done["id"] == 7, done
        assert running == 0
        wait_pool_empty(srv)
    finally:
        assert srv.stop() == 0
