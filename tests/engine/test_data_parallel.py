"""Data-parallel replicas on a local single-node Ray cluster (``ray.init()`` here, not local mode): two
replicas of the tiny random model behind ``DataParallelEngine``. Greedy outputs equal a single engine's,
shared prefixes land on one replica, both replicas get work, an abort reaches its replica, and a killed
replica fails only its own streams, is restarted by Ray and gets work again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import urllib.request

import pytest

from rawpaged.config import EngineConfig
from rawpaged.errors import InvalidRequestError, ReplicaUnavailableError
from rawpaged.sampling_params import SamplingParams
from tests.conftest import tiny_engine

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dp(ray_cluster, tiny_dir):
    from rawpaged.engine.data_parallel import DataParallelEngine

    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    engine = DataParallelEngine(config, 2, log_requests=False)
    yield engine
    engine.shutdown()


async def collect(stream):
    last = None
    async for out in stream:
        last = out
    return last


def prompts():
    shared = [(7 * i) % 250 + 3 for i in range(64)]  # four full blocks
    return [shared + [100 + i] for i in range(4)] + [[(11 * i + j) % 250 + 3 for j in range(40)] for i in range(4)]


def test_greedy_outputs_equal_one_engine_and_shared_prefixes_share_a_replica(dp, tiny_dir):
    expected = [o.outputs[0].token_ids for o in tiny_engine(tiny_dir).generate(
        [{"prompt_token_ids": p} for p in prompts()], GREEDY
    )]  # fmt: skip

    async def main():
        streams = [await dp.add_request({"prompt_token_ids": p}, GREEDY) for p in prompts()]
        outs = await asyncio.gather(*(collect(s) for s in streams))
        return [s.replica for s in streams], [o.outputs[0].token_ids for o in outs]

    replicas, got = asyncio.run(main())
    assert got == expected
    assert len(set(replicas[:4])) == 1, replicas  # one prefix, one replica (load allowed it)
    assert set(replicas) == {0, 1}, replicas
    assert dp.router.load == [0, 0] and dp.num_active_requests == 0
    stats = asyncio.run(dp.stats())
    assert [s["replica"] for s in stats["replicas"]] == [0, 1]
    assert stats["num_total_blocks"] == 128 and stats["router"]["prefix_hits"] >= 3


def test_kv_cache_snapshot_of_each_replica(dp):
    async def main():
        snaps = [await dp.kv_cache_snapshot(replica=i) for i in (0, 1)]
        default = await dp.kv_cache_snapshot(count=8)
        with pytest.raises(ValueError, match="^replica must be in"):
            await dp.kv_cache_snapshot(replica=2)
        with pytest.raises(ValueError, match="^start must be in"):  # checked by the replica, raised here
            await dp.kv_cache_snapshot(start=64, replica=1)
        return snaps, default

    snaps, default = asyncio.run(main())
    assert [s["replica"] for s in snaps] == [0, 1] and default["replica"] == 0 and default["count"] == 8
    assert all(s["num_blocks"] == 64 and len(s["blocks"]) == 64 and s["requests"] == [] for s in snaps)


def wait_idle(dp, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = asyncio.run(dp.stats())
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_used_blocks"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_abort_reaches_the_replica_and_refusals_come_back(dp):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await dp.add_request({"prompt_token_ids": [5, 6, 7]}, long)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert dp.abort(stream.request_id) and not dp.abort(stream.request_id)
        assert stream.aborted
        with pytest.raises(InvalidRequestError):  # refused by the replica's engine, raised here
            await dp.add_request({"prompt_token_ids": [5, 10**6]}, GREEDY)
        return stream.replica

    asyncio.run(main())
    wait_idle(dp)
    assert dp.router.load == [0, 0]


def test_a_killed_replica_fails_only_its_streams_and_comes_back(dp):
    long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)

    async def main():
        streams = [await dp.add_request({"prompt_token_ids": [9, i + 3]}, long) for i in range(4)]
        assert sorted(s.replica for s in streams) == [0, 0, 1, 1]
        ray.kill(dp.replicas[0], no_restart=False)
        results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        for s, r in zip(streams, results):
            if s.replica == 0:
                assert isinstance(r, ReplicaUnavailableError) and "replica 0" in str(r), r
            else:
                assert r.finished and len(r.outputs[0].token_ids) == 150
        assert dp.replica_failures[0] >= 1 and dp.router.ready[1]
        if not dp.router.ready[0]:  # (unless Ray has it back already) it gets nothing
            while_down = await dp.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY)
            assert while_down.replica == 1 and (await collect(while_down)).finished
        deadline = time.monotonic() + 120
        while not dp.router.ready[0]:  # Ray restarts the actor; the probe finds it
            assert time.monotonic() < deadline, "replica 0 did not come back"
            await asyncio.sleep(0.2)
        back = [await dp.add_request({"prompt_token_ids": [4, i]}, GREEDY) for i in range(2)]
        outs = await asyncio.gather(*(collect(s) for s in back))
        return [s.replica for s in back], outs

    replicas, outs = asyncio.run(main())
    assert sorted(replicas) == [0, 1] and all(o.finished for o in outs)
    assert dp.router.load == [0, 0]


def test_the_server_over_two_replicas(ray_cluster, tiny_dir):
    import aiohttp

    from rawpaged.entrypoints.api_server import create_app
    from tests.entrypoints.server_thread import ServerThread, run, sse

    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    from rawpaged.entrypoints.server.config import ServerConfig

    # killed replicas leave their requests for the drain to end: 2 s, not the default 30
    app = create_app(config, data_parallel_size=2, server_config=ServerConfig(shutdown_timeout=2.0))
    srv = ServerThread(app).start()
    srv.wait_healthy(timeout=180)
    prompt = "the same long prefix for every request: " * 3
    expected = tiny_engine(tiny_dir).generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text

    async def main():
        async with aiohttp.ClientSession() as s:
            replicas, texts = [], []
            for _ in range(3):
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    replicas.append(r.headers["X-Rawpaged-Replica"])
                    texts.append((await r.json())["choices"][0]["text"])
            chunks, done = await sse(s, srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
            async with s.ws_connect(srv.url + "/v1/ws") as ws:
                # the KV cache view of the replica that served the shared prefix: its blocks stay cached
                kv = {"type": "subscribe_kv_cache", "id": "kv", "replica": int(replicas[0])}
                await ws.send_json(kv)
                view = await ws.receive_json(timeout=60)
                await ws.send_json({"type": "cancel", "id": "kv"})
                await ws.send_json({"type": "generate", "id": "a", "prompt": "hello", "max_tokens": 3})
                while (msg := await ws.receive_json(timeout=60))["type"] != "done":
                    assert msg["type"] == "delta", msg
            async with s.get(srv.url + "/v1/debug/stats") as r:
                stats = await r.json()
            async with s.get(srv.url + "/metrics") as r:
                metrics = await r.text()
            async with s.get(srv.url + "/health") as r:
                assert r.status == 200
                health = await r.json()
            # a client that leaves mid-stream: its request is aborted on its replica, every block comes back
            body = {"prompt": "y", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                await r.content.readline()
            for _ in range(200):
                async with s.get(srv.url + "/v1/debug/stats") as r:
                    after = await r.json()
                if after["num_running"] == 0 and after["num_used_blocks"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert after["num_running"] == 0 and after["num_used_blocks"] == 0, after
            assert after["generation_tokens_total"] < stats["generation_tokens_total"] + 200
            # both replicas gone for good: 503s that say so, and /health says so too
            engine = srv.state.engine
            for actor in engine.replicas:
                ray.kill(actor, no_restart=True)
            for _ in range(3):
                async with s.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                    body = await r.json()
                    assert r.status == 503 and body["error"]["type"] == "service_unavailable_error", body
            async with s.get(srv.url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "unavailable"
            return replicas, texts, done, msg, stats, metrics, health, view

    try:
        replicas, texts, done, last, stats, metrics, health, view = run(main())
    finally:
        assert srv.stop() == 0
    assert view["type"] == "kv_cache" and view["replica"] == int(replicas[0]) and view["num_blocks"] == 64
    assert any(b["cached"] and b["ref_count"] == 0 for b in view["blocks"])
    assert texts == [expected] * 3 and len(set(replicas)) == 1 and replicas[0] in ("0", "1")
    assert done and last["replica"] in (0, 1)
    assert [s["replica"] for s in stats["replicas"]] == [0, 1] and stats["router"]["prefix_hits"] >= 2
    assert 'rawpaged:num_total_blocks{replica="0"} 64.0' in metrics
    assert 'rawpaged:num_total_blocks{replica="1"} 64.0' in metrics
    assert 'rawpaged:replica_up{replica="1"} 1.0' in metrics
    assert 'rawpaged:router_requests_total{decision="prefix_hit"}' in metrics
    assert health["status"] == "ok" and [(r["replica"], r["ready"]) for r in health["replicas"]] == [
        (0, True),
        (1, True),
    ]


@pytest.mark.model
def test_the_default_model_through_two_replicas(ray_cluster, model_dir, llm):
    """The issue's end-to-end check: a long shared prefix lands on one replica, both replicas get work,
    greedy outputs equal a single engine's, and /metrics shows both replicas."""
    import openai

    from rawpaged.entrypoints.api_server import create_app
    from tests.entrypoints.server_thread import ServerThread

    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=128, max_model_len=512)
    srv = ServerThread(create_app(config, data_parallel_size=2)).start()
    srv.wait_healthy(timeout=300)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    system = "You are a terse assistant for a museum. " * 8  # > 4 blocks once templated
    questions = ["Who painted the Mona Lisa?", "What is a sculpture?", "When do you open?"]
    short = ["Once upon a time", "The sky is", "Paris is", "One, two,"]
    try:
        chats = [
            client.chat.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=12,
                temperature=0,
            )
            for q in questions
        ]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent: the load spreads them
            completions = list(
                pool.map(
                    lambda p: client.completions.with_raw_response.create(
                        model="SmolLM2-135M-Instruct", prompt=p, max_tokens=10, temperature=0
                    ),
                    short,
                )
            )
        metrics = urllib.request.urlopen(srv.url + "/metrics", timeout=30).read().decode()
    finally:
        assert srv.stop() == 0
    chat_replicas = {r.headers["x-rawpaged-replica"] for r in chats}
    assert len(chat_replicas) == 1, chat_replicas
    assert {r.headers["x-rawpaged-replica"] for r in completions} == {"0", "1"}
    expected = llm.generate(short, SamplingParams(temperature=0.0, max_tokens=10))
    assert [r.parse().choices[0].text for r in completions] == [o.outputs[0].text for o in expected]
    expected_chats = [
        llm.chat(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            SamplingParams(temperature=0.0, max_tokens=12),
        )[0]
        .outputs[0]
        .text
        for q in questions
    ]
    assert [r.parse().choices[0].message.content for r in chats] == expected_chats
    for i in (0, 1):
        assert f'rawpaged:num_total_blocks{{replica="{i}"}} 128.0' in metrics
    assert 'rawpaged:router_requests_total{decision="prefix_hit"} 2.0' in metrics


def test_a_replica_that_dies_idle_is_noticed_by_the_health_checks(dp):
    async def main():
        assert [r["ready"] for r in dp.replica_health()] == [True, True]  # starts the checks
        failures = dp.replica_failures[1]
        ray.kill(dp.replicas[1], no_restart=False)
        deadline = time.monotonic() + 30
        while dp.replica_failures[1] == failures:  # (Ray may have it back by the time it is noticed)
            assert time.monotonic() < deadline, "the dead replica was not noticed"
            await asyncio.sleep(0.1)
        during = await dp.add_request({"prompt_token_ids": [8, 8, 8]}, GREEDY)
        assert (await collect(during)).finished
        deadline = time.monotonic() + 120
        while not dp.replica_health()[1]["ready"]:
            assert time.monotonic() < deadline, "replica 1 did not come back"
            await asyncio.sleep(0.2)
        stats = await dp.stats()
        return [r["ready"] for r in stats["replicas"]], {r["pid"] for r in stats["replicas"]}

    ready, pids = asyncio.run(main())
    assert ready == [True, True] and len(pids) == 2


def test_cli_refuses_a_ray_address_alone_and_an_unreachable_one(capsys):
    from rawpaged.engine.data_parallel import check_ray_address
    from rawpaged.entrypoints.cli import serve_main

    assert serve_main(["--ray-address", "127.0.0.1:9", "--port", "0"]) == 1
    assert "--ray-address needs --data-parallel-size" in capsys.readouterr().err
    with pytest.raises(ConnectionError, match="no Ray cluster answers at 127.0.0.1:9"):
        check_ray_address("127.0.0.1:9")  # what serve_main prints as its error before ray.init
