"""``StructuredOutputManager``: grammars compiled off the step loop, cached by constraint."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

import numpy as np

from rawpaged.optional_imports import import_optional
from rawpaged.structured_output.params import StructuredOutputsParams


class StructuredOutputManager:
    """Compiles constraints into matchers, in a thread, and builds the step's bitmask.

    Args:
        tokenizer: the model's ``Tokenizer``.
        vocab_size: the model's logits width (None: the tokenizer's).
        eos_token_ids: the ids that end generation (None: the tokenizer's EOS).
        cache_size: compiled constraints kept (least recently used dropped first).

    The tokenizer is wrapped for llguidance on first use (about 0.3 s for a 49k vocabulary), in the
    compile thread like every compilation, so that neither engine start-up nor the step loop waits.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_token_ids=None, cache_size: int = 256):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._backend = None  # a GuidanceBackend, created on first use
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        self._lock = Lock()
        self._compile_lock = Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-output")
        self.num_compiled = 0  # constraints compiled (cache misses)

    @property
    def backend(self):
        """The ``GuidanceBackend`` (created on first use).

        Raises:
            MissingDependencyError (an ``InvalidRequestError``) when llguidance is not installed.
        """
        with self._lock:
            if self._backend is None:
                import_optional("llguidance", "structured outputs", param="structured_outputs")
                from rawpaged.structured_output.backend_guidance import GuidanceBackend

                self._backend = GuidanceBackend(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._backend

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher for ``params`` (its grammar from the cache, or compiled now).

        Raises:
            InvalidRequestError naming the field when the constraint does not compile.
        """
        key = params.key()
        with self._compile_lock:  # one compilation at a time, so that a key is compiled once
            with self._lock:
                spec = self._cache.get(key)
                if spec is not None:
                    self._cache.move_to_end(key)
            if spec is None:
                spec = self.backend.grammar_spec(params)
                with self._lock:
                    self.num_compiled += 1
                    self._cache[key] = spec
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
        return self.backend.grammar(spec)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """``compile(params)`` in the compile thread; the future holds the matcher or the error."""
        return self._pool.submit(self.compile, params)

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
            from rawpaged.structured_output.backend_guidance import fill_bitmasks_parallel

            fill_bitmasks_parallel(grammars, bitmask, self.backend.executor)
        return bitmask

    def shutdown(self) -> None:
        """Stop the compile thread (pending compilations finish first)."""
        self._pool.shutdown(wait=True)
