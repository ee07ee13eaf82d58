"""``EngineClient``: what the server's routes use of an engine (as vLLM's ``engine/protocol.py``). A single
``AsyncEngine`` and the data-parallel ``DataParallelEngine`` both provide it."""

from __future__ import annotations

from typing import Protocol

from rawpaged.engine.async_engine import RequestStream
from rawpaged.sampling_params import SamplingParams
from rawpaged.tokenizer import Tokenizer


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
        self, prompt, params: SamplingParams, request_id: str | None = None, log_label: str | None = None
    ) -> RequestStream:
        """Queue a request; its stream of cumulative ``RequestOutput``s."""

    def abort(self, request_id: str) -> bool:
        """End a request now; False if unknown or finished."""

    async def stats(self) -> dict:
        """The engine's counters (``LLMEngine.stats`` and more)."""

    async def kv_cache_snapshot(
        self, start: int = 0, count: int | None = None, since_event: int | None = None, replica: int | None = None
    ) -> dict:
        """A snapshot of a KV block pool (``rawpaged.core.kv_cache_snapshot.to_json``); raises ValueError
        for a bad range or replica."""

    async def close(self) -> None: ...
