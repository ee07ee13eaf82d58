"""Speculative decoding through ``python server.py --speculative-config`` (a subprocess, small random
model): a streamed completion equals the same request unstreamed (several tokens may come in one delta),
``/metrics`` has the draft counters and accepted tokens per position, and a bad config is refused at
start-up naming the key."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp

from tests.entrypoints.test_kv_memory_server import _metric
from tests.entrypoints.test_shutdown import ROOT, start_server

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
BODY = {"prompt": "one two three four " * 12, "max_tokens": 48, "temperature": 0, "ignore_eos": True}


async def _requests(url: str):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url + "/v1/completions", json=BODY) as r:
            assert r.status == 200, await r.text()
            whole = await r.json()
        deltas = []
        async with s.post(url + "/v1/completions", json=dict(BODY, stream=True)) as r:
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    deltas.append(json.loads(line[6:])["choices"][0]["text"])
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
        return whole, deltas, metrics


def test_speculative_decoding_through_the_server(tiny_dir):
    proc, url, log = start_server(tiny_dir, "--speculative-config", SPEC)
    try:
        whole, deltas, metrics = asyncio.run(_requests(url))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
        log += proc.stderr.readlines()
    assert code == 0, "".join(log)
    assert "".join(deltas) == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 48
    drafts = _metric(metrics, "rawpaged:spec_decode_num_draft_tokens")
    accepted = _metric(metrics, "rawpaged:spec_decode_num_accepted_tokens")
    assert drafts > 0 and 0 <= accepted <= drafts
    assert 'rawpaged:spec_decode_num_accepted_tokens_per_pos_total{position="3"}' in metrics


def test_a_bad_speculative_config_is_refused_naming_the_key(tiny_dir):
    bad = json.dumps({"method": "ngram", "num_speculative_token": 4})
    proc = subprocess.run(
        [sys.executable, "server.py", "--model", str(tiny_dir), "--speculative-config", bad],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "num_speculative_token" in proc.stderr and "unknown key" in proc.stderr
