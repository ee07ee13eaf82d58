"""AsyncEngine without a model: slow consumers never block others, aborts take effect before the next
step, errors reach their caller and the loop survives them."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from rawpaged.engine import async_engine
from rawpaged.engine.async_engine import AsyncEngine
from rawpaged.engine.outputs import CompletionOutput, RequestOutput
from rawpaged.errors import EngineDeadError, RequestFailedError
from rawpaged.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(coro)


class FakeEngine:
    """Just enough of LLMEngine: each step adds one character/token to every request."""

    def __init__(self, step_time=0.005):
        self.requests = {}
        self.tokenizer = None
        self.max_model_len = 100
        self.step_time = step_time
        self.log = []
        self.fail_next = False
        self.fail_request = None

    def add_request(self, prompt, params, request_id, grammar=None, lora_request=None):
        if not prompt:
            raise ValueError("prompt is empty")
        self.requests[request_id] = SimpleNamespace(prompt_token_ids=[1, 2, 3], n=0, max=params.max_tokens)
        return request_id

    def step(self):
        self.log.append(("step", set(self.requests)))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        time.sleep(self.step_time)
        outs = []
        for rid, r in list(self.requests.items()):
            r.n += 1
            fin = r.n >= r.max
            if rid == self.fail_request:  # the engine ends this request alone
                outs.append(RequestOutput(rid, None, r.prompt_token_ids, [], True, error="ValueError: poisoned"))
                del self.requests[rid]
                continue
            outs.append(
                RequestOutput(
                    rid,
                    None,
                    r.prompt_token_ids,
                    [CompletionOutput(0, "x" * r.n, list(range(r.n)), "length" if fin else None)],
                    fin,
                )
            )
            if fin:
                del self.requests[rid]
        return outs

    def abort_request(self, rid):
        self.log.append(("abort", rid))
        return self.requests.pop(rid, None) is not None

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return {"num_requests": len(self.requests)}

    def close(self):
        self.log.append(("close",))


def test_async_engine_slow_consumer_never_blocks_others():
    async def main():
        fake = FakeEngine()
        ae = AsyncEngine(fake, log_requests=False)
        slow = await ae.add_request("a", SamplingParams(max_tokens=40), "slow")  # never read while b runs
        fast = await ae.add_request("b", SamplingParams(max_tokens=5), "fast")
        outs = [o async for o in fast]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5] and outs[-1].finished
        first = await slow.__anext__()  # only the newest state was kept: several tokens at once
        assert len(first.outputs[0].token_ids) >= 5
        rest = [o async for o in slow]
        assert rest[-1].finished and rest[-1].outputs[0].text == "x" * 40
        await ae.close()

    run(main())


def test_async_engine_abort_takes_effect_before_next_step():
    async def main():
        fake = FakeEngine(step_time=0.02)
        ae = AsyncEngine(fake, log_requests=False)
        stream = await ae.add_request("a", SamplingParams(max_tokens=1000), "a")
        await stream.__anext__()
        await stream.__anext__()
        steps_before = sum(1 for e in fake.log if e[0] == "step")
        assert ae.abort("a") and not ae.abort("a")
        assert [o async for o in stream] == [] and stream.aborted
        await ae.stats()  # a round trip through the engine thread
        i = fake.log.index(("abort", "a"))
        steps_with_a = [k for k, e in enumerate(fake.log) if e[0] == "step" and "a" in e[1]]
        assert all(k < i for k in steps_with_a)  # no step after the abort saw it
        assert len(steps_with_a) <= steps_before + 1  # at most the step that was running
        assert ae.num_active_requests == 0
        await ae.close()

    run(main())


def test_async_engine_errors_reach_the_caller_and_the_loop_survives():
    async def main():
        fake = FakeEngine()
        ae = AsyncEngine(fake, log_requests=False)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("", SamplingParams(max_tokens=3))
        fake.fail_next = True
        doomed = await ae.add_request("a", SamplingParams(max_tokens=3))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in doomed:
                pass
        ok = await ae.add_request("b", SamplingParams(max_tokens=3))
        assert [o async for o in ok][-1].finished
        await ae.close()
        with pytest.raises(EngineDeadError):
            await ae.add_request("c", SamplingParams(max_tokens=3))

    run(main())


def test_async_engine_a_request_failed_alone_raises_only_in_its_stream():
    async def main():
        fake = FakeEngine()
        fake.fail_request = "bad"
        ae = AsyncEngine(fake, log_requests=False)
        bad = await ae.add_request("a", SamplingParams(max_tokens=5), "bad")
        good = await ae.add_request("b", SamplingParams(max_tokens=5), "good")
        with pytest.raises(RequestFailedError, match="poisoned"):
            async for _ in bad:
                pass
        assert [o async for o in good][-1].outputs[0].text == "x" * 5
        assert ae.num_active_requests == 0
        await ae.close()

    run(main())


async def _first_step_of_two(ae, fake, first: str, second: str, pause) -> set:
    """Add ``first``, await ``pause()``, add ``second``; drain both; the ids in the first step that ran."""
    a = await ae.add_request("p", SamplingParams(max_tokens=1), first)
    await pause()
    b = await ae.add_request("p", SamplingParams(max_tokens=1), second)
    [o async for o in a], [o async for o in b]
    await ae.close()
    return next(e[1] for e in fake.log if e[0] == "step")


async def _event_loop_rounds(n=3):
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("gather", [True, False])
def test_an_idle_engine_gathers_requests_that_arrive_together(gather, monkeypatch):
    """A request whose handler reaches the engine a few event-loop rounds after another one (clients
    sending together) is in the same first step; with the gather turned off it misses it, so the test
    sees the race it guards against."""
    if not gather:
        monkeypatch.setattr(async_engine, "GATHER_MAX_S", 0.0)

    async def main():
        fake = FakeEngine(step_time=0.05)
        return await _first_step_of_two(AsyncEngine(fake, log_requests=False), fake, "a", "b", _event_loop_rounds)

    assert run(main()) == ({"a", "b"} if gather else {"a"})


@pytest.mark.parametrize("expect", [True, False])
def test_an_engine_that_just_finished_k_requests_waits_for_k_arrivals(expect, monkeypatch):
    """Closed-loop clients: two streams end in the same step, their clients send again 50 ms apart
    (longer than the quiet window); the idle engine waits for both before its first step. Without the
    expectation (finished requests too long ago) the second misses it."""
    monkeypatch.setattr(async_engine, "GATHER_MAX_S", 1.0)
    if not expect:
        monkeypatch.setattr(async_engine, "GATHER_RECENT_S", 0.0)

    async def main():
        fake = FakeEngine(step_time=0.01)
        ae = AsyncEngine(fake, log_requests=False)
        first = [await ae.add_request("p", SamplingParams(max_tokens=2), rid) for rid in ("a", "b")]
        for stream in first:
            [o async for o in stream]
        fake.log.clear()
        return await _first_step_of_two(ae, fake, "c", "d", lambda: asyncio.sleep(0.05))

    assert run(main()) == ({"c", "d"} if expect else {"c"})
