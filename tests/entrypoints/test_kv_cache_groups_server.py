"""KV cache groups as a server shows them, on the hybrid random Qwen2 (2 full layers, 2 with a window of 8):
``--disable-hybrid-kv-cache-manager`` parses into the engine config; ``/v1/debug/kv_cache`` lists the groups
and each sequence's table per group; ``/metrics`` has a series per group; with the hybrid manager off there
is one group of every layer."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import asyncio
import re

import aiohttp

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.cli import build_serve_parser, engine_config_from_args
from tests.entrypoints.server_thread import served
from tests.model_reference import write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-server") / "qwen2_hybrid"
    write_checkpoint(d, "qwen2_hybrid")
    return d


def test_the_flag_parses_as_vllms():
    parser = build_serve_parser()
    on = engine_config_from_args(parser.parse_args(["--model", "m"]))
    off = engine_config_from_args(parser.parse_args(["--model", "m", "--disable-hybrid-kv-cache-manager"]))
    assert (on.disable_hybrid_kv_cache_manager, off.disable_hybrid_kv_cache_manager) == (False, True)


async def _look(url: str) -> tuple:
    body = {"prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def snapshot_while_running():
            for _ in range(400):
                async with s.get(url + "/v1/debug/kv_cache") as r:
                    snap = await r.json()
                if snap["requests"] and any(q["num_computed_tokens"] > 20 for q in snap["requests"][0]["sequences"]):
                    return snap
                await asyncio.sleep(0.01)
            return snap

        async def complete():
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        snap, _ = await asyncio.gather(snapshot_while_running(), complete())
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    return snap, metrics


@pytest.mark.parametrize("disable", [False, True], ids=["hybrid", "hybrid-off"])
def test_the_debug_view_and_metrics_show_the_groups(checkpoint, disable):
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        max_model_len=128,
        disable_hybrid_kv_cache_manager=disable,
    )
    with served(config) as srv:
        snap, metrics = asyncio.run(_look(srv.url))
    groups = snap["kv_cache_groups"]
    if disable:
        assert [(g["kind"], g["layer_ids"]) for g in groups] == [("full_attention", [0, 1, 2, 3])]
    else:
        assert [(g["kind"], g["layer_ids"]) for g in groups] == [
            ("full_attention", [0, 1]),
            ("sliding_window_8", [2, 3]),
        ]
    (seq,) = snap["requests"][0]["sequences"]
    assert len(seq["block_tables"]) == len(groups) and seq["block_table"] == seq["block_tables"][0]
    assert (-1 in seq["block_tables"][-1]) == (not disable)  # the window's passed blocks given back
    kinds = set(re.findall(r'^rawpaged:kv_cache_group_used_blocks\{group="(\d)",kind="(\w+)"\}', metrics, re.M))
    assert kinds == {(str(g["group_id"]), g["kind"]) for g in groups}
    frees = re.search(
        r'^rawpaged:kv_cache_group_window_frees_total\{group="1",kind="sliding_window_8"\} (\S+)$', metrics, re.M
    )
    assert (frees is not None and float(frees.group(1)) > 0) == (not disable)
