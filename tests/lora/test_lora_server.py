"""LoRA adapters through the HTTP server (``--lora-modules``, a request's ``model``): two adapters and the base
model give the tokens the offline ``LLM`` gives with the same ``lora_request``; ``/v1/models`` lists them
with their ``parent``; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` round trip, refuse bad
adapters (400, nothing kept, every block back), refuse to unload an adapter in use (409, its request
unbroken) and answer 404 while runtime updating is off; unknown names are a 404 naming what is served; the
websocket, Responses and Messages APIs pick adapters by ``model``; the metrics and the command line."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json
import re
import threading
import time

import aiohttp

from rawpaged import LLM, LoRARequest, SamplingParams
from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.cli import build_serve_parser
from rawpaged.entrypoints.server.lora_registry import LoRAModulePath, parse_lora_module
from rawpaged.testing.random_lora import write_random_adapter
from tests.entrypoints.server_thread import openai_client, run, served, stats, ws_generate
from tests.lora.test_lora_adapters import BAD

MAX_LEN = 128
MAX_TOKENS = 8
PROMPTS = [[(5 * i + 7 * j + 3) % 250 + 3 for i in range(9 + 2 * j)] for j in range(3)]


def _config(lora_base, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(lora_base), device="cpu", num_kv_blocks=64, max_model_len=MAX_LEN, enable_lora=True, max_loras=2, **kw
    )


def wait_pool_empty(srv, timeout=10.0) -> dict:
    """Poll ``/v1/debug/stats`` until nothing runs and every KV block is free but those holding resident
    adapters' weights, where the pool pages them (``lora_adapter_pages``); the stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(srv)
        pages = s.get("lora_adapter_pages", 0)
        if s["num_free_blocks"] + pages == s["num_total_blocks"] and not (
            s["num_running"] or s["num_waiting"] or s["num_active_streams"]
        ):
            return s
        assert time.monotonic() < deadline, f"blocks not returned: {s}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def offline(lora_base):
    return LLM(
        model=str(lora_base), device="cpu", num_kv_blocks=64, max_model_len=MAX_LEN, enable_lora=True, max_loras=2
    )


@pytest.fixture(scope="module")
def srv(lora_base, adapters):
    modules = [f"a0={adapters[0]}", json.dumps({"name": "a1", "path": str(adapters[1]), "base_model_name": "tiny"})]
    with served(
        _config(lora_base), served_model_name="tiny", lora_modules=modules, allow_runtime_lora_updating=True
    ) as s:
        yield s


def _greedy(offline, prompt, lora) -> list:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return offline.generate([{"prompt_token_ids": prompt}], params, lora_request=lora)[0].outputs[0].token_ids


async def _post(url, body) -> tuple:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


def post(srv, path, body) -> tuple:
    return run(_post(srv.url + path, body))


def _completion(model, prompt) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return {**body, "model": model, "return_token_ids": True}


def test_two_adapters_and_the_base_in_one_batch_match_offline(srv, offline, adapters):
    loras = {"tiny": None, "a0": LoRARequest("a0", 1, str(adapters[0])), "a1": LoRARequest("a1", 2, str(adapters[1]))}
    jobs = [(model, prompt) for model in loras for prompt in PROMPTS]

    async def main():
        async with aiohttp.ClientSession() as s:

            async def one(model, prompt):
                async with s.post(srv.url + "/v1/completions", json=_completion(model, prompt)) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            return await asyncio.gather(*(one(m, p) for m, p in jobs))  # sent together: one batch

    replies = run(main())
    got = {(m, tuple(p)): r["choices"][0]["token_ids"] for (m, p), r in zip(jobs, replies)}
    assert [r["model"] for r in replies] == [m for m, _ in jobs]  # an adapter's answer names it, as vLLM's
    for model, prompt in jobs:
        assert got[model, tuple(prompt)] == _greedy(offline, prompt, loras[model]), model
    for prompt in PROMPTS:  # the adapters change the tokens: the comparison above can fail
        assert (
            got["a0", tuple(prompt)] != got["tiny", tuple(prompt)]
            or got["a1", tuple(prompt)] != got["tiny", tuple(prompt)]
        )
    wait_pool_empty(srv)


def test_chat_through_the_openai_sdk_picks_the_adapter(srv, offline, adapters):
    client = openai_client(srv)
    extra = {"return_token_ids": True, "ignore_eos": True}
    messages = [{"role": "user", "content": "hello there"}]
    for model, lora in (("a1", LoRARequest("a1", 2, str(adapters[1]))), ("tiny", None)):
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra
        )
        assert r.model == model
        prompt = r.model_extra["prompt_token_ids"]
        assert prompt == offline.engine.tokenizer.encode_chat(messages)[1]
        assert r.choices[0].model_extra["token_ids"] == _greedy(offline, prompt, lora)


def test_models_lists_the_adapters_with_their_parent(srv, adapters):
    client = openai_client(srv)
    assert [m.id for m in client.models.list().data] == ["tiny", "a0", "a1"]
    status, body = run(_get(srv.url + "/v1/models"))
    cards = {c["id"]: c for c in body["data"]}
    assert status == 200 and cards["tiny"]["parent"] is None and cards["tiny"]["root"] == "tiny"
    for name, path in (("a0", adapters[0]), ("a1", adapters[1])):
        assert cards[name]["root"] == str(path) and cards[name]["parent"] == "tiny"
        assert cards[name]["object"] == "model" and cards[name]["max_model_len"] == MAX_LEN
    card = client.models.retrieve("a0")
    assert card.id == "a0" and card.model_extra["parent"] == "tiny" and card.model_extra["root"] == str(adapters[0])


async def _get(url) -> tuple:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def test_an_unknown_model_is_a_404_naming_the_served_ones(srv):
    import openai

    client = openai_client(srv)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    body = e.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "`nope`" in body["message"] and all(f"`{n}`" in body["message"] for n in ("tiny", "a0", "a1"))


def test_load_and_unload_round_trip(srv, offline, lora_base, tmp_path):
    path = write_random_adapter(tmp_path / "a2", lora_base, rank=4, std=0.1, seed=21)
    status, text = post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(path)})
    assert status == 200 and text == "Success: LoRA adapter 'a2' added successfully."
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(path)})[0] == 400  # loaded
    lora = srv.state.loras.get("a2")
    status, body = post(srv, "/v1/completions", _completion("a2", PROMPTS[0]))
    assert status == 200 and body["model"] == "a2"
    assert body["choices"][0]["token_ids"] == _greedy(offline, PROMPTS[0], LoRARequest("a2", 90, str(path)))
    assert "a2" in [c["id"] for c in run(_get(srv.url + "/v1/models"))[1]["data"]]
    status, text = post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200 and text == "Success: LoRA adapter 'a2' removed successfully."
    assert "a2" not in [c["id"] for c in run(_get(srv.url + "/v1/models"))[1]["data"]]
    assert lora.lora_int_id not in srv.state.engine.engine.list_loras()  # the engine forgot it too
    status, body = post(srv, "/v1/completions", _completion("a2", PROMPTS[0]))
    assert status == 404 and "`a2`" in body["error"]["message"]
    status, body = post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 404 and body["error"]["message"] == "The lora adapter 'a2' cannot be found."
    # loaded again under the same name: a new id, the same tokens
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(path)})[0] == 200
    assert srv.state.loras.get("a2").lora_int_id > lora.lora_int_id
    want = _greedy(offline, PROMPTS[0], LoRARequest("a2", 90, str(path)))
    assert post(srv, "/v1/completions", _completion("a2", PROMPTS[0]))[1]["choices"][0]["token_ids"] == want
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 200
    wait_pool_empty(srv)


def test_unloading_an_adapter_in_use_is_a_409_and_its_request_finishes(srv, offline, lora_base, tmp_path):
    path = write_random_adapter(tmp_path / "busy", lora_base, rank=8, std=0.1, seed=31)
    assert post(srv, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(path)})[0] == 200
    engine = srv.state.engine
    lora_id = srv.state.loras.get("busy").lora_int_id
    gate = threading.Event()
    engine._executor.submit(gate.wait, 30)  # the engine thread waits: the request stays in flight
    result = {}
    client = threading.Thread(
        target=lambda: result.update(r=post(srv, "/v1/completions", _completion("busy", PROMPTS[1])))
    )
    client.start()
    try:
        deadline = time.monotonic() + 10
        while engine.num_lora_requests(lora_id) == 0:
            assert time.monotonic() < deadline, "the request never arrived"
            time.sleep(0.01)
        status, body = post(srv, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        assert status == 409 and body["error"]["param"] == "lora_name"
        assert re.search(r"'busy' is in use by 1 request", body["error"]["message"])
        assert "busy" in srv.state.loras
    finally:
        gate.set()
    client.join(30)
    status, body = result["r"]
    assert status == 200 and body["choices"][0]["token_ids"] == _greedy(
        offline, PROMPTS[1], LoRARequest("busy", 91, str(path))
    )
    assert post(srv, "/v1/unload_lora_adapter", {"lora_name": "busy"})[0] == 200  # free once it finished
    wait_pool_empty(srv)


@pytest.mark.parametrize(
    "case, field",
    [
        ("rank over max_lora_rank", "max_lora_rank"),
        ("a module the model lacks", "no such linear"),
        ("another base's shapes", "shape mismatch"),
        ("no weights file", "adapter_model.safetensors"),
        ("a missing directory", "lora_path"),
    ],
)
def test_a_bad_adapter_is_a_400_and_nothing_is_kept(srv, offline, adapters, lora_base, tmp_path, case, field):
    make, pattern = BAD[case]
    path = make(tmp_path / "bad", lora_base)
    before = srv.state.engine.engine.list_loras()
    status, body = post(srv, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
    assert status == 400 and body["error"]["param"] == "lora_path", body
    message = body["error"]["message"]
    assert "'bad'" in message and field in message and re.search(pattern, message), message
    assert "bad" not in srv.state.loras and srv.state.engine.engine.list_loras() == before
    assert "bad" not in [c["id"] for c in run(_get(srv.url + "/v1/models"))[1]["data"]]
    status, body = post(srv, "/v1/completions", _completion("a0", PROMPTS[2]))  # the others keep running
    assert status == 200
    assert body["choices"][0]["token_ids"] == _greedy(offline, PROMPTS[2], LoRARequest("a0", 1, str(adapters[0])))
    s = wait_pool_empty(srv)
    assert s["num_free_blocks"] + s.get("lora_adapter_pages", 0) == s["num_total_blocks"]


def test_adapter_routes_answer_404_while_runtime_updating_is_off(srv, adapters):
    srv.state.allow_runtime_lora_updating = False
    try:
        for path, body in (
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters[2])}),
            ("/v1/unload_lora_adapter", {"lora_name": "a0"}),
        ):
            status, reply = post(srv, path, body)
            assert status == 404 and "--allow-runtime-lora-updating" in reply["error"]["message"]
    finally:
        srv.state.allow_runtime_lora_updating = True
    assert "a0" in srv.state.loras


def test_bad_load_and_unload_bodies(srv, adapters):
    for body, param in (
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_path": str(adapters[2])}, "lora_name"),
        ({"lora_name": "", "lora_path": str(adapters[2])}, "lora_name"),
        ({"lora_name": "tiny", "lora_path": str(adapters[2])}, "lora_name"),  # the base model's name
    ):
        status, reply = post(srv, "/v1/load_lora_adapter", body)
        assert status == 400 and reply["error"]["param"] == param, (body, reply)
    status, reply = post(srv, "/v1/unload_lora_adapter", {"lora_name": "a0", "lora_int_id": 77})
    assert status == 400 and reply["error"]["param"] == "lora_int_id"


def test_the_websocket_picks_an_adapter_by_model(srv, offline, adapters):
    message = {"id": "w", "model": "a1", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    text, _ = run(ws_generate(srv.url, {**message, "ignore_eos": True}))
    want = _greedy(offline, PROMPTS[0], LoRARequest("a1", 2, str(adapters[1])))
    assert text == offline.engine.tokenizer.decode(want)
    base, _ = run(ws_generate(srv.url, {**message, "model": "tiny", "ignore_eos": True}))
    assert base == offline.engine.tokenizer.decode(_greedy(offline, PROMPTS[0], None))


def test_responses_and_messages_pick_an_adapter_by_model(srv):
    messages = [{"role": "user", "content": "hi"}]

    def chat_text(model):
        body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        status, reply = post(srv, "/v1/chat/completions", body)
        assert status == 200
        return reply["choices"][0]["message"]["content"]

    for model in ("a0", "a1", "tiny"):  # the same conversation, the same greedy text as chat's
        body = {"model": model, "input": "hi", "max_output_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        status, reply = post(srv, "/v1/responses", body)
        assert status == 200 and reply["model"] == model, reply
        text = "".join(c["text"] for item in reply["output"] for c in item.get("content", []) if "text" in c)
        body = {"model": model, "max_tokens": 6, "messages": messages, "temperature": 0.0, "ignore_eos": True}
        status, message = post(srv, "/v1/messages", body)
        assert status == 200 and message["model"] == model, message
        assert text == message["content"][0]["text"] == chat_text(model), model
    assert chat_text("a0") != chat_text("tiny") or chat_text("a1") != chat_text("tiny")
    assert post(srv, "/v1/responses", {"model": "zz", "input": "hi"})[0] == 404
    assert post(srv, "/v1/messages", {"model": "zz", "max_tokens": 2, "messages": messages})[0] == 404


def test_metrics_report_the_adapters(srv):
    post(srv, "/v1/completions", _completion("a0", PROMPTS[0]))
    status, text = run(_get(srv.url + "/metrics"))
    assert status == 200
    assert re.search(
        r'rawpaged:lora_requests_info\{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""\} ', text
    )
    assert re.search(r"^rawpaged:lora_adapters_registered 2\.0$", text, re.M)
    loads = re.search(r"^rawpaged:lora_loads_total (\d+)\.0$", text, re.M)
    assert loads and int(loads[1]) >= 1
    assert re.search(r'^rawpaged:lora_requests_running\{lora_name="a0"\} 0\.0$', text, re.M)
    assert re.search(r'^rawpaged:lora_requests_waiting\{lora_name="a1"\} 0\.0$', text, re.M)


def test_engine_stats_count_each_adapters_running_and_waiting_requests(lora_base, adapters):
    llm = LLM(
        model=str(lora_base), device="cpu", num_kv_blocks=64, max_model_len=MAX_LEN, enable_lora=True, max_loras=1
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a0, a1 = LoRARequest("a0", 1, str(adapters[0])), LoRARequest("a1", 2, str(adapters[1]))
    for i, lora in enumerate((a0, a0, a1, None)):
        engine.add_request({"prompt_token_ids": PROMPTS[i % 3]}, params, lora_request=lora)
    lora = engine.stats()["lora"]
    assert lora["waiting_lora_adapters"] == ["a0", "a1"] and lora["running_lora_adapters"] == []
    assert lora["adapters"]["a0"]["num_requests_waiting"] == 2 and lora["num_registered"] == 2
    deadline = time.monotonic() + 30
    while not engine.stats()["lora"]["running_lora_adapters"]:  # where adapters load in the background: a
        assert time.monotonic() < deadline  # step or more before their requests run
        engine.step()
        time.sleep(0.01)
    lora = engine.stats()["lora"]  # max_loras 1: a0's requests run, a1's waits
    assert lora["running_lora_adapters"] == ["a0"] and lora["waiting_lora_adapters"] == ["a1"]
    assert lora["adapters"]["a0"]["num_requests_running"] == 2 and lora["adapters"]["a0"]["resident"]
    assert lora["num_resident"] == 1 and lora["num_loads"] == 1
    with pytest.raises(ValueError, match="2 unfinished request"):
        engine.remove_lora(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(1) and set(engine.list_loras()) == {2}
    assert engine.stats()["lora"]["num_registered"] == 1


def test_lora_module_syntax_and_flags(lora_base):
    assert parse_lora_module("sql=/a/b=c") == LoRAModulePath("sql", "/a/b=c")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad, match in (
        ("nopath", "expected name=path"),
        ("=/p", "name must be a non-empty"),
        ('{"name": "x"}', "path must be a non-empty"),
        ('{"name": "x", "path": "/p", "rank": 8}', r"unknown key\(s\) \['rank'\]"),
        ("{bad json", "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_lora_module(bad)
    args = build_serve_parser().parse_args(
        [
            "--enable-lora",
            "--lora-modules",
            "a=/p",
            '{"name": "b", "path": "/q"}',
            "--max-cpu-loras",
            "4",
            "--max-loras",
            "2",
        ]
    )
    assert args.lora_modules == [LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q")]
    assert args.max_cpu_loras == 4 and args.enable_lora and not args.allow_runtime_lora_updating
    assert build_serve_parser().parse_args(["--allow-runtime-lora-updating"]).allow_runtime_lora_updating
    with pytest.raises(ValueError, match=r"max_cpu_loras must be an int >= max_loras \(2\), got 1"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    assert EngineConfig(max_loras=2, max_cpu_loras=8).max_cpu_loras == 8
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        create_app(EngineConfig(model=str(lora_base)), lora_modules=["a=/p"])
    with pytest.raises(ValueError, match="given twice|already been loaded"):
        create_app(_config(lora_base), lora_modules=["a=/p", "a=/q"])
    with pytest.raises(ValueError, match="data-parallel"):
        create_app(_config(lora_base), data_parallel_size=2)


def test_a_bad_lora_module_fails_the_start(lora_base, tmp_path):
    path = write_random_adapter(tmp_path / "big", lora_base, rank=32)
    from tests.entrypoints.server_thread import ServerThread

    srv = ServerThread(create_app(_config(lora_base), lora_modules=[f"big={path}"])).start()
    try:
        deadline = time.monotonic() + 120
        while srv.state.load_error is None:
            assert time.monotonic() < deadline and srv.state.engine is None
            time.sleep(0.05)
        assert "'big'" in srv.state.load_error and "max_lora_rank 16" in srv.state.load_error
    finally:
        srv.stop()
