"""``StructuredOutputManager``: grammars compiled off the step loop, cached by constraint."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

import numpy as np

from rawpaged.errors import InvalidRequestError, import_optional
from rawpaged.structured_output.params import StructuredOutputsParams

#: compiles that may run at once (llguidance releases the GIL while it builds a grammar)
COMPILE_WORKERS = 4
#: seconds a request waits for its grammar before it is refused (the compile goes on, and its result is
#: cached for the next request with the same constraint)
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class StructuredOutputManager:
    """Compiles constraints into matchers, in a small thread pool, and builds the step's bitmask.

    Args:
        tokenizer: the model's ``Tokenizer``.
        vocab_size: the model's logits width (None: the tokenizer's).
        eos_token_ids: the ids that end generation (None: the tokenizer's EOS).
        cache_size: compiled constraints kept (least recently used dropped first), refusals included.
        compile_workers: compiles that run at once; different constraints never wait for each other
            beyond that, and one constraint is compiled once however many requests ask for it.
        compile_timeout_s: how long ``compile_await`` waits for a grammar.
        disable_additional_properties: JSON Schemas compile strict (``GuidanceBackend``'s argument).

    The tokenizer is wrapped for llguidance on first use (about 0.3 s for a 49k vocabulary), in a
    compile thread like every compilation, so that neither engine start-up nor the step loop waits.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int | None = None,
        eos_token_ids=None,
        cache_size: int = 256,
        compile_workers: int = COMPILE_WORKERS,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        disable_additional_properties: bool = True,
    ):
        self.disable_additional_properties = disable_additional_properties
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._backend = None  # a GuidanceBackend, created on first use
        self._cache: OrderedDict = OrderedDict()  # key -> grammar spec, or the InvalidRequestError it raised
        self._cache_size = cache_size
        self._pending: dict = {}  # key -> Future of the compile in progress
        self._lock = Lock()
        self._backend_lock = Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="structured-output")
        self.compile_timeout_s = compile_timeout_s
        self.num_compiled = 0  # constraints compiled (cache misses)

    @property
    def backend(self):
        """The ``GuidanceBackend`` (created on first use).

        Raises:
            MissingDependencyError (an ``InvalidRequestError``) when llguidance is not installed.
        """
        with self._backend_lock:
            if self._backend is None:
                import_optional("llguidance", "structured outputs", param="structured_outputs")
                from rawpaged.structured_output.backend_guidance import GuidanceBackend  # deferred: llguidance

                self._backend = GuidanceBackend(
                    self._tokenizer, self._vocab_size, self._eos_token_ids, self.disable_additional_properties
                )
            return self._backend

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher for ``params`` (its grammar from the cache, or compiled now; a compile of the
        same constraint already running in another thread is waited for, not repeated).

        Raises:
            InvalidRequestError naming the field when the constraint does not compile, or is over the
            grammar engine's limits at its first token (``GuidanceBackend.probe``).
        """
        backend = self.backend  # MissingDependencyError without llguidance (not a refusal to cache)
        key = params.key()
        owner = False
        with self._lock:
            spec = self._cache.get(key)
            if spec is not None:
                self._cache.move_to_end(key)
            else:
                pending = self._pending.get(key)
                if pending is None:
                    pending = self._pending[key] = Future()
                    owner = True
        if spec is None and not owner:
            spec = pending.result()
        elif spec is None:
            try:
                spec = backend.grammar_spec(params)
            except InvalidRequestError as e:
                spec = e  # refusals are cached too: a slow schema that fails is not compiled again
            except BaseException as e:
                with self._lock:
                    del self._pending[key]
                pending.set_exception(e)
                raise
            with self._lock:
                self.num_compiled += 1
                self._cache[key] = spec
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                del self._pending[key]
            pending.set_result(spec)
        if isinstance(spec, InvalidRequestError):
            raise InvalidRequestError(str(spec), spec.param)
        return backend.grammar(spec)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """``compile(params)`` in a compile thread; the future holds the matcher or the error."""
        return self._pool.submit(self.compile, params)

    async def compile_await(self, params: StructuredOutputsParams, timeout_s: float | None = None):
        """``compile(params)`` in a compile thread, awaited for at most ``timeout_s`` (default
        ``compile_timeout_s``; None for no limit).

        Raises:
            InvalidRequestError naming ``structured_outputs`` when the compile takes longer (it goes on in
            its thread, and the next request for the same constraint gets its result), or as ``compile``.
        """
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        future = self.compile_async(params)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            raise InvalidRequestError(
                f"structured_outputs: the grammar did not compile within {timeout_s:g} s "
                "(--grammar-compile-timeout); a simpler schema compiles faster",
                "structured_outputs",
            ) from None

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """int32 ``[rows, ceil(vocab / 32)]`` with every token allowed (all bits set)."""
        return np.full((rows, (self.backend.vocab_size + 31) // 32), -1, dtype=np.int32)

    def grammar_bitmask(self, grammars: list) -> np.ndarray:
        """The bitmask of the next token for each matcher of ``grammars``, one row each, in order (several
        rows are computed in parallel, on llguidance's own threads)."""
        bitmask = self.allocate_bitmask(len(grammars))
        if len(grammars) == 1:
            grammars[0].fill_bitmask(bitmask, 0)
        elif grammars:
            from rawpaged.structured_output.backend_guidance import fill_bitmasks_parallel  # deferred: llguidance

            fill_bitmasks_parallel(grammars, bitmask, self.backend.executor)
        return bitmask

    def shutdown(self) -> None:
        """Stop the compile thread (pending compilations finish first)."""
        self._pool.shutdown(wait=True)
