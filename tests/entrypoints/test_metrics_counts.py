"""Each metric counts its events once: one request of n choices is one TTFT, one end-to-end latency, n
finish reasons and (tokens - 1) inter-token gaps per choice stream; a refusal is one HTTP error; a
repeated prompt is one prefix-cache hit per cached block; the token counters add what was computed."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio

import aiohttp

from rawpaged.config import EngineConfig
from tests.entrypoints.server_thread import run, served, wait_pool_empty

BLOCK = 16


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=128, block_size=BLOCK)
    with served(config) as srv:
        yield srv


async def scrape(s, url) -> dict:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def exchange(server, requests: list) -> tuple:
    """Run ``requests`` (``(path, body)``) one after another; the metrics' change and the bodies."""

    async def main():
        async with aiohttp.ClientSession() as s:
            before = await scrape(s, server.url)
            bodies = []
            for path, body in requests:
                async with s.post(server.url + path, json=body) as r:
                    bodies.append((r.status, await r.json()))
            await asyncio.to_thread(wait_pool_empty, server)
            return delta(before, await scrape(s, server.url)), bodies

    return run(main())


def test_one_request_of_three_choices(server):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "n": 3, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    d, [(status, out)] = exchange(server, [("/v1/completions", body)])
    assert status == 200, out
    assert d['rawpaged:request_success_total{finished_reason="length"}'] == 3
    assert d["rawpaged:time_to_first_token_seconds_count"] == 1
    assert d["rawpaged:e2e_request_latency_seconds_count"] == 1
    # one output per step after the first: 4 tokens, 3 gaps
    assert d["rawpaged:inter_token_latency_seconds_count"] == 3
    assert d["rawpaged:generation_tokens_total"] == 12
    assert d["rawpaged:prompt_tokens_total"] == 5  # the prompt's blocks are shared by the 3 choices
    assert not any(k.startswith("rawpaged:http_request_errors") for k in d)


def test_one_refusal_is_one_error(server):
    d, [(status, _)] = exchange(server, [("/v1/completions", {"prompt": "x", "max_tokens": -1})])
    assert status == 400
    assert d['rawpaged:http_request_errors_total{status="400"}'] == 1
    assert not any(k.startswith(("rawpaged:request_success", "rawpaged:time_to_first", "rawpaged:e2e")) for k in d)


def test_a_repeated_prompt_hits_once_per_cached_block(server):
    prompt = list(range(10, 10 + 3 * BLOCK + 4))  # 3 full blocks and a partial one
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    d, bodies = exchange(server, [("/v1/completions", body), ("/v1/completions", body)])
    assert [b[0] for b in bodies] == [200, 200]
    assert d["rawpaged:prefix_cache_hits_total"] == 3
    assert d["rawpaged:prompt_tokens_total"] == len(prompt) + (len(prompt) - 3 * BLOCK)
    assert d["rawpaged:time_to_first_token_seconds_count"] == 2
    assert d['rawpaged:request_success_total{finished_reason="length"}'] == 2
