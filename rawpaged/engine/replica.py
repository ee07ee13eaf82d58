"""One data-parallel replica: an ``LLMEngine`` driven by an ``AsyncEngine`` inside a Ray actor
(``DataParallelEngine`` makes the actors; this class knows nothing of Ray and runs as a plain object in
tests).

Ray runs an actor whose methods are coroutines on the actor's own event loop, so the ``AsyncEngine``
lives there; ``generate`` is an async generator, which Ray streams to the caller item by item
(``num_returns="streaming"``).
"""

from __future__ import annotations

import os

from rawpaged.config import EngineConfig
from rawpaged.engine.async_engine import AsyncEngine
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.sampling_params import SamplingParams

#: what ``generate`` yields first, once the replica has queued the request
ACCEPTED = "accepted"


class EngineReplica:
    """Args:
    config: the engine's configuration (the same for every replica).
    index: this replica's index, reported in ``info``.

    The model is loaded and warmed up in the constructor (Ray reruns it when it restarts the actor).
    """

    def __init__(self, config: EngineConfig, index: int):
        self.index = index
        self.llm_engine = LLMEngine(config)
        self.llm_engine.warmup()
        self._engine: AsyncEngine | None = None

    def _async_engine(self) -> AsyncEngine:
        if self._engine is None:  # first call, on the actor's event loop
            self._engine = AsyncEngine(self.llm_engine, log_requests=False)
        return self._engine

    async def info(self) -> dict:
        """What a front end needs to tokenize and check prompts itself (``FrontEnd.describe``: the
        tokenizer as its JSON and config, the model's and the pool's limits), and the pool's block size."""
        e = self.llm_engine
        return {
            "index": self.index,
            **e.parts.front_end.describe(),
            "block_size": e.input_processor.block_size,
            "default_sampling_params": e.default_sampling_params,
        }

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        """Yield ``ACCEPTED`` once the request is queued (a refusal raises first: InvalidRequestError or
        ValueError), then its cumulative ``RequestOutput``s. Closing the generator early aborts it."""
        engine = self._async_engine()
        stream = await engine.add_request(prompt, params, request_id)
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        finally:
            engine.abort(request_id)

    async def ping(self) -> int:
        """The replica's index: an answer means it is alive (the front end's health checks)."""
        return self.index

    async def abort(self, request_id: str) -> bool:
        return self._async_engine().abort(request_id)

    async def stats(self) -> dict:
        stats = await self._async_engine().stats()
        stats["replica"] = self.index
        stats["pid"] = os.getpid()
        return stats

    async def kv_cache_snapshot(self, start: int = 0, count: int | None = None, since_event: int | None = None):
        """This replica's KV cache snapshot (``AsyncEngine.kv_cache_snapshot``) with its ``replica`` index."""
        snapshot = await self._async_engine().kv_cache_snapshot(start, count, since_event)
        snapshot["replica"] = self.index
        return snapshot

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()
