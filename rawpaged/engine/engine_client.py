"""What the server's routes see of an engine: ``EngineClient`` (as vLLM's ``engine/protocol.py``), which a
single ``AsyncEngine`` and the data-parallel ``DataParallelEngine`` both provide, and the ``RequestStream``
each of them hands back for a request (its outputs, newest state only: a slow consumer sees fewer,
larger steps and memory stays bounded; see ``async_engine``'s "Streams")."""

from __future__ import annotations

import asyncio
from typing import Protocol

from rawpaged.engine.outputs import RequestOutput
from rawpaged.sampling_params import SamplingParams
from rawpaged.tokenizer import Tokenizer


class RequestStream:
    """Async iterator of one request's ``RequestOutput``s (newest state only, see module doc).

    Iteration ends after the finished output, or early when the request was aborted (``aborted`` is
    then True). Raises ``EngineDeadError`` if the engine failed, ``RequestFailedError`` if the engine
    ended this request alone. ``replica`` is the data-parallel replica serving it (None for a single
    engine); ``lora_int_id`` the LoRA adapter it runs with (0: none).
    """

    def __init__(self, request_id: str, replica: int | None = None, lora_int_id: int = 0):
        self.request_id = request_id
        self.replica = replica
        self.lora_int_id = lora_int_id
        self.aborted = False
        self.finished = False
        self._latest: RequestOutput | None = None
        self._done = False
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished:
            self._done = self.finished = True
        self._event.set()

    def close(self, error: BaseException | None = None, aborted: bool = False) -> None:
        self._done = True
        self._error = error
        self.aborted = aborted
        self._event.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                return out
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()


class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int

    @property
    def default_sampling_params(self) -> dict:
        """The model's sampling defaults (``generation_config.json``)."""

    @property
    def num_active_requests(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Sequences run in one step at most (over all replicas)."""

    def end_requests(self, error: BaseException) -> int:
        """End every request in flight with ``error``; returns how many."""

    def check_prompt(self, ids: list) -> None:
        """Raises InvalidRequestError for prompt token ids the engine would refuse."""

    async def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        log_label: str | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request (``lora_request``: the ``LoRARequest`` it runs with, or None); its stream of
        cumulative ``RequestOutput``s."""

    def abort(self, request_id: str) -> bool:
        """End a request now; False if unknown or finished."""

    async def add_lora(self, lora_request) -> bool:
        """Load and check a LoRA adapter (``LLMEngine.add_lora``); raises InvalidRequestError."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; raises ``LoRAInUseError`` while requests in flight use it."""

    def num_lora_requests(self, lora_int_id: int) -> int:
        """Requests in flight that run with adapter ``lora_int_id``."""

    async def stats(self) -> dict:
        """The engine's counters (``LLMEngine.stats`` and more)."""

    async def kv_cache_snapshot(
        self, start: int = 0, count: int | None = None, since_event: int | None = None, replica: int | None = None
    ) -> dict:
        """A snapshot of a KV block pool (``rawpaged.core.kv_cache_snapshot.to_json``); raises ValueError
        for a bad range or replica."""

    async def close(self) -> None: ...
