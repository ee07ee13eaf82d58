"""The host's copies of loaded adapters (vLLM's ``--max-cpu-loras``): at most ``capacity`` ``LoRAModel``s,
least recently used dropped beyond it (read from disk again when needed), loaded on a worker thread so the
engine's steps go on while an adapter's files are read.

The worker only reads files (``load``); its results join the cache on the caller's thread (``poll``), so
what the cache holds changes only where the engine looks at it.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable


class CPUAdapterCache:
    """Args:
        load: ``load(lora_request) -> LoRAModel`` (raises ValueError for an adapter that cannot be loaded).
        capacity: models kept at most (None: no limit); >= 1.
        background: load on the worker thread (True) or at once in ``request`` (False).

    Attributes:
        num_loads: adapters read from disk; num_evictions: models dropped beyond ``capacity``.
    """

    def __init__(self, load: Callable, capacity: int | None = None, background: bool = True):
        if capacity is not None and capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1 or None, got {capacity}")
        self._load, self.capacity, self.background = load, capacity, background
        self._models: OrderedDict = OrderedDict()  # lora_int_id -> LoRAModel, least recently used first
        self._pending: set = set()
        self._done: list = []  # (lora_int_id, LoRAModel or exception), from the worker
        self._lock = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.failed: dict = {}  # lora_int_id -> the exception its last load raised
        self.num_loads = 0
        self.num_evictions = 0

    def __contains__(self, lora_int_id: int) -> bool:
        self.poll()
        return lora_int_id in self._models

    def __len__(self) -> int:
        return len(self._models)

    @property
    def num_pending(self) -> int:
        """Loads asked for and not yet in the cache (being read, or read and not yet polled)."""
        with self._lock:
            return len(self._pending)

    def get(self, lora_int_id: int):
        """The loaded model (now the most recently used), or None."""
        self.poll()
        model = self._models.get(lora_int_id)
        if model is not None:
            self._models.move_to_end(lora_int_id)
        return model

    def put(self, model) -> None:
        """Keep ``model`` (most recently used), dropping the least recently used beyond ``capacity``."""
        self._models[model.id] = model
        self._models.move_to_end(model.id)
        while self.capacity is not None and len(self._models) > self.capacity:
            self._models.popitem(last=False)
            self.num_evictions += 1

    def discard(self, lora_int_id: int) -> None:
        """Forget a model (and a failure of its load)."""
        self._models.pop(lora_int_id, None)
        self.failed.pop(lora_int_id, None)

    def load_now(self, request):
        """Read ``request``'s adapter on this thread, keep it and return it (ValueError as ``load``)."""
        model = self._load(request)
        self.num_loads += 1
        self.put(model)
        return model

    def request(self, request) -> None:
        """Make sure ``request``'s adapter gets loaded: nothing if it is cached or pending, else a load on
        the worker (or at once without ``background``; a failure then goes to ``failed`` too)."""
        lid = request.lora_int_id
        if lid in self or lid in self.failed:
            return
        if not self.background:
            try:
                self.load_now(request)
            except ValueError as e:
                self.failed[lid] = e
            return
        with self._lock:
            if lid in self._pending:
                return
            self._pending.add(lid)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="lora-loader", daemon=True)
            self._thread.start()
        self._queue.put(request)

    def poll(self) -> None:
        """Move the worker's finished loads into the cache (failures into ``failed``)."""
        with self._lock:
            done, self._done = self._done, []
            for lid, _ in done:
                self._pending.discard(lid)
        for lid, result in done:
            if isinstance(result, Exception):
                self.failed[lid] = result
            else:
                self.num_loads += 1
                self.put(result)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a pending load to finish; True if one did (or none is
        pending)."""
        with self._lock:
            if not self._pending or self._done:
                return True
            return self._lock.wait_for(lambda: bool(self._done), timeout)

    def _work(self) -> None:
        while True:
            request = self._queue.get()
            try:
                result = self._load(request)
            except Exception as e:  # noqa: BLE001 - handed to the engine, which fails the adapter's requests
                result = e
            with self._lock:
                self._done.append((request.lora_int_id, result))
                self._lock.notify_all()
