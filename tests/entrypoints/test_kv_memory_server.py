"""KV memory options end to end through ``python server.py`` (a subprocess, small random model): an int8 KV
cache and a second tier in a directory, under a pool too small for the load (swaps); ``/metrics`` and
``/v1/debug/kv_cache`` show the tier; SIGTERM flushes it, and a restarted server serves the same prompt
from it, with the same answer."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import os
import re
import signal

import aiohttp

from tests.entrypoints.test_shutdown import start_server

ARGS = ("--kv-cache-dtype", "int8", "--kv-offloading-size", "0.01", "--num-kv-blocks", "12", "--max-num-seqs", "8")
PROMPT = {"prompt": "the cache " * 8, "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def _run(url: str, concurrent: int):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(i):
            body = dict(PROMPT, prompt=PROMPT["prompt"] + f" {i}" * (i + 1)) if i else PROMPT
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["choices"][0]["text"]

        texts = await asyncio.gather(*(one(i) for i in range(concurrent)))
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
        async with s.get(url + "/v1/debug/kv_cache") as r:
            snapshot = await r.json()
        return texts, metrics, snapshot


def test_int8_kv_and_a_second_tier_through_the_server(tiny_dir, tmp_path):
    args = (*ARGS, "--kv-offload-dir", str(tmp_path))
    proc, url, log = start_server(tiny_dir, *args)
    try:
        texts, metrics, snapshot = asyncio.run(_run(url, 6))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
        log += proc.stderr.readlines()
    assert code == 0, "".join(log)
    assert _metric(metrics, "rawpaged:num_offload_slots") > 0
    assert _metric(metrics, "rawpaged:num_swapped_out") > 0, "a 12-block pool under 6 requests should swap"
    assert _metric(metrics, "rawpaged:num_swapped_in") == _metric(metrics, "rawpaged:num_swapped_out")
    assert snapshot["offload"]["num_slots"] > 0 and snapshot["offload"]["prefix_stores"] > 0
    assert list(tmp_path.glob("kv-*.bin")), "the tier's file"

    proc, url, log = start_server(tiny_dir, *args)
    try:
        (again,), metrics, _ = asyncio.run(_run(url, 1))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
        log += proc.stderr.readlines()
    assert code == 0, "".join(log)
    assert again == texts[0]
    assert _metric(metrics, "rawpaged:offload_prefix_hits") > 0, "the restarted server should load the prefix"
    assert "cached blocks found" in "".join(log)
