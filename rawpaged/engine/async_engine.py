"""The asyncio side of the engine: one background task steps ``LLMEngine`` while work exists.

Threading model
---------------
Every call into ``LLMEngine`` (``step``, ``add_request``, ``abort_request``, ``stats``) runs on one
dedicated single-thread executor, so the engine is never touched by two threads and the event loop stays
responsive while a step computes. While requests run, the loop submits step N+1 as soon as step N
returns, before it hands N's outputs to the streams, so the engine thread does not wait for the
streams' writes (vLLM v1's async scheduling overlaps the same host work). The executor is FIFO: an
``add`` or ``abort`` submitted while step N runs is executed before step N+1, so an aborted request's
blocks are back in the pool before it; one submitted while N's outputs are delivered comes after N+1.

Streams
-------
Each request has a ``RequestStream``. The engine loop never awaits a client: it hands each
``RequestOutput`` to the stream without blocking. ``RequestOutput``s are cumulative (whole text and token
ids per choice so far), so a stream only keeps the newest one: a slow consumer sees fewer, larger steps
and memory stays bounded; a dead one costs nothing until its request is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from rawpaged.core import kv_cache_snapshot
from rawpaged.engine.engine_client import RequestStream
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.engine.request_stats import RequestStatsTracker, finish_reasons
from rawpaged.errors import EngineDeadError, InvalidRequestError, LoRAInUseError, RequestFailedError
from rawpaged.sampling_params import SamplingParams

logger = logging.getLogger("rawpaged.server")
#: an idle engine that gets a request waits until no other request has arrived for GATHER_QUIET_S
#: (GATHER_MAX_S at most) before its first step, so that requests sent together are prefilled together;
#: when its last step finished k requests less than GATHER_RECENT_S before, it also waits (as long) for
#: k arrivals: clients that send their next request as soon as a response ends
GATHER_QUIET_S = 0.001
GATHER_MAX_S = 0.020
GATHER_RECENT_S = 0.050


class AsyncEngine:
    """Drives an ``LLMEngine`` from asyncio. Create it inside a running event loop (or first use it there).

    ``metrics`` is an optional ``rawpaged.entrypoints.server.metrics.ServerMetrics``; ``log_requests`` writes
    one INFO line per finished or aborted request.
    """

    def __init__(self, engine: LLMEngine, metrics=None, log_requests: bool = True):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.request_stats = RequestStatsTracker(metrics, log_requests)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rawpaged-engine")
        self._streams: dict[str, RequestStream] = {}
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._num_arrivals = 0  # add_request calls so far (``_gather_arrivals``)
        # when the engine last went idle, how many requests its last step finished, arrivals by then
        self._idle_since = (float("-inf"), 0, 0)
        self._removed_loras: set[int] = set()  # adapters ``remove_lora`` removed: requests for them are refused
        self._closed = False

    # ------------------------------------------------------------------ public API
    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs in one step at most (``EngineConfig.max_num_seqs``)."""
        return self.engine.config.max_num_seqs

    @property
    def default_sampling_params(self) -> dict:
        """The model's ``generation_config.json`` sampling defaults (``LLMEngine.default_sampling_params``)."""
        return self.engine.default_sampling_params

    def check_prompt(self, ids: list) -> None:
        """The engine's checks of a prompt's token ids (``InputProcessor.check_prompt``): raises
        InvalidRequestError."""
        self.engine.input_processor.check_prompt(ids)

    async def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        log_label: str | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request (it joins the batch at the next step) and return its stream.

        ``prompt`` and ``params`` (``SamplingParams``, or ``PoolingParams`` for an embedding) are what
        ``LLMEngine.add_request`` takes, ``lora_request`` its LoRA adapter (``rawpaged.lora.request.LoRARequest``,
        or None); ``log_label`` goes into the request's log line (e.g. a client's own id). The request counts
        as a user of its adapter (``num_lora_requests``) from this call on, before any await. Raises ValueError
        (nothing queued) for an invalid request, a duplicate id or an adapter ``remove_lora`` has removed
        (InvalidRequestError, param "model"); EngineDeadError after ``close``.
        """
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._ensure_loop()
        self._num_arrivals += 1
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        if lora_int_id in self._removed_loras:
            raise InvalidRequestError(f"the LoRA adapter {lora_request.lora_name!r} was unloaded", "model")
        stream = RequestStream(request_id, lora_int_id=lora_int_id)
        self._streams[request_id] = stream
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            grammar = None
            # compiled in the manager's threads, off the step loop (PoolingParams have none)
            if getattr(params, "structured_outputs", None) is not None:
                manager = self.engine.structured_output_manager
                grammar = await manager.compile_await(params.structured_outputs)
            if stream.aborted:  # aborted while its grammar compiled: it never reaches the engine
                return stream
            # no await between the check above and this submit: an abort from now on is queued on the
            # engine thread after the add, so it finds the request there and removes it
            n_prompt = await loop.run_in_executor(
                self._executor, self._add, prompt, params, request_id, grammar, lora_request
            )
        except asyncio.CancelledError:
            self.abort(request_id)  # runs after the add on the engine thread: nothing is left behind
            raise
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        if stream.aborted:  # aborted while being added (the abort ran after the add)
            return stream
        self.request_stats.arrived(request_id, arrival, n_prompt, log_label)
        self._wake.set()
        return stream

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None, lora_request=None):
        """Async generator of ``RequestOutput``s (``lora_request``: as ``add_request``); leaving it early
        aborts the request."""
        stream = await self.add_request(prompt, params, request_id, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(stream.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its stream ends, and the engine drops it (and frees its blocks) before
        its next step. Safe to call from cancellation handlers. False if unknown or already finished."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.close(aborted=True)
        try:
            self._executor.submit(self.engine.abort_request, request_id)
        except RuntimeError:  # executor shut down: the engine is gone anyway
            pass
        self.request_stats.finished(request_id, "abort", time.monotonic())
        return True

    def end_requests(self, error: BaseException) -> int:
        """End every request in flight with ``error`` (their streams raise it) and drop them from the
        engine before its next step; returns how many (a server's shutdown, after its timeout)."""
        n = len(self._streams)
        self._fail_all(error)
        return n

    # ------------------------------------------------------------------ LoRA adapters
    async def add_lora(self, lora_request) -> bool:
        """``LLMEngine.add_lora`` on the engine thread (between steps): the adapter loaded and checked.
        Raises InvalidRequestError (the message naming the adapter and the field) for one that cannot be
        loaded, or one removed before (ids are not reused); EngineDeadError after ``close``."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if lora_request.lora_int_id in self._removed_loras:
            raise InvalidRequestError(f"lora_int_id {lora_request.lora_int_id} was removed", "lora_request")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id``; False if the engine did not have it. Raises ``LoRAInUseError``
        (nothing changed) while a request in flight runs with it: those requests are never broken. From
        this call on, requests for it are refused (``add_request``); the engine thread forgets it after
        the step under way and any aborts queued before."""
        users = self.num_lora_requests(lora_int_id)
        if users:
            raise LoRAInUseError(f"{users} request(s) in flight use the adapter", users)
        self._removed_loras.add(lora_int_id)
        if self._closed:
            return False
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self.engine.remove_lora, lora_int_id)
        except BaseException:
            self._removed_loras.discard(lora_int_id)
            raise

    def num_lora_requests(self, lora_int_id: int) -> int:
        """Requests in flight (queued, waiting or running) that run with adapter ``lora_int_id``."""
        return sum(1 for s in self._streams.values() if s.lora_int_id == lora_int_id)

    async def stats(self) -> dict:
        """``LLMEngine.stats()`` taken between steps, plus ``num_active_streams``."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stats = await loop.run_in_executor(self._executor, self.engine.stats)
        stats["num_active_streams"] = len(self._streams)
        return stats

    async def kv_cache_snapshot(
        self, start: int = 0, count: int | None = None, since_event: int | None = None, replica: int | None = None
    ) -> dict:
        """A snapshot of the KV block pool (``rawpaged.core.kv_cache_snapshot.to_json``), copied between
        steps on the engine thread and turned into JSON-ready data here.

        Raises:
            ValueError: a bad block range, or a ``replica`` other than None or 0 (one engine).
            EngineDeadError: after ``close``.
        """
        if replica not in (None, 0):
            raise ValueError(f"replica must be 0: this server runs one engine, got {replica}")
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        kv_cache_snapshot.check_range(self.engine.kv_cache_manager.num_blocks, start, count, since_event)
        loop = asyncio.get_running_loop()
        state = await loop.run_in_executor(self._executor, self.engine.kv_cache_state, start, count, since_event)
        return kv_cache_snapshot.to_json(state)

    async def close(self) -> None:
        """Stop the loop, end every stream with EngineDeadError and release the engine thread."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(EngineDeadError("the server is shutting down"))
        # the engine thread finishes its step before the tier's file is flushed and closed
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        self.engine.close()

    # ------------------------------------------------------------------ engine thread
    def _add(self, prompt, params, request_id, grammar, lora_request) -> int:
        self.engine.add_request(prompt, params, request_id, grammar, lora_request=lora_request)
        return len(self.engine.requests[request_id].prompt_token_ids)

    def _step(self):
        outputs = self.engine.step()
        return outputs, self.engine.has_unfinished_requests()

    def _abort_all(self, request_ids) -> None:
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort after a failure
                logger.exception("abort of %s failed", rid)

    # ------------------------------------------------------------------ event loop
    def _ensure_loop(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rawpaged-engine-loop")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        busy = False
        pending = None  # the next step, submitted before the last one's outputs were delivered
        while True:
            if pending is None:
                if not busy:
                    await self._wake.wait()
                    await self._gather_arrivals(loop)
                self._wake.clear()
                pending = loop.run_in_executor(self._executor, self._step)
            try:
                outputs, busy = await pending
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
                pending = None
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                busy = False
                continue
            pending = None
            if busy and outputs:  # step N+1 computes while step N's outputs go out to the streams
                self._wake.clear()
                pending = loop.run_in_executor(self._executor, self._step)
            self._deliver(outputs)
            if not busy:
                finished = sum(1 for out in outputs if out.finished)
                self._idle_since = (loop.time(), finished, self._num_arrivals)
            # Let handlers run (new requests, aborts) between steps; back off if nothing could run.
            await asyncio.sleep(0 if outputs or not busy else 0.005)

    async def _gather_arrivals(self, loop) -> None:
        """Requests sent together (clients whose streams ended in the same step) reach their handlers one
        after another: wait for them and for a quiet moment, so they are prefilled in one step. Otherwise
        the late ones are prefilled in the next step, and the early ones' second token waits for that
        prefill."""
        now = loop.time()
        deadline = now + GATHER_MAX_S
        idle_since, finished, arrivals = self._idle_since
        expected = arrivals + (finished if now - idle_since < GATHER_RECENT_S else 1)
        while loop.time() < deadline:
            seen = self._num_arrivals
            await asyncio.sleep(GATHER_QUIET_S)
            if self._num_arrivals == seen and seen >= expected:
                return

    def _deliver(self, outputs: list) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            stream = self._streams.get(rid)
            if stream is None:  # aborted while the step ran
                continue
            if out.error is not None:  # the engine ended this request alone
                self._streams.pop(rid, None)
                stream.close(error=RequestFailedError(f"the request failed: {out.error}"))
                self.request_stats.finished(rid, "error", now)
                continue
            self.request_stats.output(out, now)
            stream.put(out)
            if out.finished:
                self._streams.pop(rid, None)
                self.request_stats.finished(rid, finish_reasons(out), now)

    def _fail_all(self, error: BaseException) -> None:
        rids = list(self._streams)
        for rid in rids:
            self._streams.pop(rid).close(error=error)
            self.request_stats.discard(rid)
        if rids and not self._closed:
            try:
                self._executor.submit(self._abort_all, rids)
            except RuntimeError:
                pass
