"""Aborts that arrive at any point of a request's path through ``AsyncEngine.add_request`` win: while its
grammar compiles, while the engine thread adds it, before its first step, mid-stream and after it ended.
After each, no request is left in the engine and every block is back."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rawpaged.engine.async_engine import AsyncEngine
from rawpaged.sampling_params import SamplingParams
from rawpaged.structured_output.params import StructuredOutputsParams
from tests.conftest import tiny_engine

PHASES = ["compiling", "adding", "added", "streaming", "finished"]


async def _idle(ae: AsyncEngine, timeout_s=10.0) -> dict:
    """Engine stats once no request is left on the engine thread."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await ae.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            return stats
        assert asyncio.get_running_loop().time() < deadline, stats
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("phase", PHASES)
def test_an_abort_at_any_point_wins_and_returns_every_block(tiny_dir, phase, monkeypatch):
    llm = tiny_engine(tiny_dir)
    engine = llm.engine
    compiled = asyncio.Event()  # set by the test: the grammar's compile may finish
    in_add, release_add = threading.Event(), threading.Event()
    real_add = engine.add_request

    def gated_add(*args, **kwargs):
        in_add.set()
        assert release_add.wait(10)
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", gated_add)
    manager = engine.structured_output_manager
    real_compile = manager.compile_await

    async def gated_compile(params, timeout_s=None):
        await compiled.wait()
        return await real_compile(params, timeout_s)

    monkeypatch.setattr(manager, "compile_await", gated_compile)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,60}")
    )

    async def main():
        ae = AsyncEngine(engine, log_requests=False)
        task = asyncio.create_task(ae.add_request({"prompt_token_ids": [5, 6, 7]}, params, "r"))
        await asyncio.sleep(0.01)
        if phase == "compiling":  # the abort arrives before the engine has heard of the request
            assert ae.abort("r")
            compiled.set()
            release_add.set()
        else:
            compiled.set()
            assert await asyncio.to_thread(in_add.wait, 10)
            if phase == "adding":  # while the engine thread adds it
                assert ae.abort("r")
            release_add.set()
        stream = await task
        if phase == "added":
            assert ae.abort("r")
        outs = []
        async for out in stream:
            outs.append(out)
            if phase == "streaming" and len(outs) == 2:
                assert ae.abort("r")
        if phase == "finished":
            assert stream.finished and not ae.abort("r")
        else:
            assert stream.aborted and not stream.finished
        stats = await _idle(ae)
        assert ae.num_active_requests == 0
        await ae.close()
        return stats

    stats = asyncio.run(main())
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert not engine.has_unfinished_requests() and not engine.requests


def test_aborts_swept_over_the_event_loops_turns(tiny_dir):
    """The same without gates: an abort after k turns of the event loop, for k from 0 (before the request
    exists: a no-op) to hundreds; every k leaves the engine empty."""
    llm = tiny_engine(tiny_dir)
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,9}")
    )

    async def one(ae, k) -> bool:
        task = asyncio.create_task(ae.add_request({"prompt_token_ids": [5, 6, 7]}, params, f"r{k}"))
        for _ in range(k):
            await asyncio.sleep(0)
        aborted = ae.abort(f"r{k}")
        stream = await task
        async for _ in stream:
            pass
        stats = await _idle(ae)
        assert stats["num_free_blocks"] == stats["num_total_blocks"], (k, stats)
        assert not llm.engine.requests, k
        return aborted

    async def main():
        ae = AsyncEngine(llm.engine, log_requests=False)
        aborted = [await one(ae, k) for k in [*range(40), 100, 400]]
        await ae.close()
        return aborted

    aborted = asyncio.run(main())
    assert not aborted[0] and sum(aborted) >= 10, aborted
