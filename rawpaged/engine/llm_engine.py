"""The engine core: requests in (``add_request``, ``abort_request``), one ``step()`` at a time, outputs out.

A step: the ``Scheduler`` picks what runs -> the ``ModelRunner`` computes logits for the sequences that
reached their last token -> new samples fork (``parallel_sampling``), beams branch (``beam_search``), the
backend samples -> ``Scheduler.update_from_output`` appends tokens, stops and frees -> the
``OutputProcessor`` makes text and ``RequestOutput``s. ``AsyncEngine`` drives it from asyncio, ``LLM``
offline.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from rawpaged.config import EngineConfig
from rawpaged.core import kv_cache_snapshot
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import SchedulerStats
from rawpaged.core.sequence import Sequence, SequenceStatus
from rawpaged.engine import beam_search
from rawpaged.engine.engine_parts import build_engine_parts
from rawpaged.engine.logprobs import prompt_logprob_entries
from rawpaged.engine.lora_stats import lora_stats
from rawpaged.engine.outputs import RequestOutput
from rawpaged.engine.pooling import POOLING_SAMPLING_PARAMS, Pooling, finish_pooled
from rawpaged.engine.request import Request
from rawpaged.engine.token_selection import SelectedTokens, TokenSelector
from rawpaged.engine.warmup import run_warmup
from rawpaged.errors import InvalidRequestError
from rawpaged.kernels import get_backend
from rawpaged.model_executor.logits_processors import logits_rules
from rawpaged.pooling_params import PoolingParams
from rawpaged.sampling_params import SamplingParams
from rawpaged.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("rawpaged.engine")


class LLMEngine:
    """Continuous-batching engine over the paged KV cache.

    Its parts come from ``engine_parts.build_engine_parts`` (kept, frozen, as ``parts``); ``model``,
    ``tokenizer``, ``scheduler``, ``runner`` and the other attributes are those parts.

    Raises (constructor): ValueError for a bad model directory or configuration; RuntimeError when
    ``device="cuda"`` and no usable GPU exists.
    """

    def __init__(self, config: EngineConfig):
        parts = self.parts = build_engine_parts(config, get_backend(config.device))
        target = parts.target
        self.config, self.model_dir, self.generation_config = config, parts.model_dir, parts.generation_config
        self.model_config, self.tokenizer, self.model = target.model_config, target.tokenizer, target.model
        self.backend, self.dtype, self.kv_cache_dtype = target.backend, target.dtype, target.kv_cache_dtype
        self.max_model_len, self.kv_block_bytes = target.max_model_len, parts.kv_block_bytes
        self.eos_token_ids, self.kv_cache_key = parts.eos_token_ids, parts.kv_cache_key
        self.kv_offload = parts.kv_offload  # None once closed
        self.scheduler, self.runner, self.speculator = parts.scheduler, target.runner, parts.speculator
        self.input_processor, self.output_processor = parts.front_end.input_processor, parts.output_processor
        self.reasoning_end_token_id = parts.reasoning_end_token_id
        self.token_selector = TokenSelector(
            self.runner,
            lambda grammars: self.structured_output_manager.grammar_bitmask(grammars),
            self._fork,
            self.eos_token_ids,
            self.max_model_len,
            self.tokenizer,
            reasoning_end_token_id=self.reasoning_end_token_id,
        )
        #: what pooling requests (embeddings) pool with (``engine.pooling``)
        self.pooling = Pooling.for_model(config.pooler_config, self.model_dir, self.model_config.hidden_size)
        self.requests: dict[str, Request] = {}
        self._structured_output_manager = None
        self._rng = np.random.default_rng(config.seed)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    @property
    def default_sampling_params(self) -> dict:
        """``SamplingParams`` defaults from the model's ``generation_config.json`` (temperature, top_p,
        top_k, min_p, repetition_penalty where it sets them), applied where a request leaves a field unset
        (vLLM's ``--generation-config auto``)."""
        return dict(self.generation_config.sampling_defaults)

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    # ------------------------------------------------------------------ requests
    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Compiles ``structured_outputs`` constraints (created on first use)."""
        if self._structured_output_manager is None:
            self._structured_output_manager = StructuredOutputManager(
                self.tokenizer,
                self.model_config.vocab_size,
                self.eos_token_ids,
                compile_timeout_s=self.config.grammar_compile_timeout,
                disable_additional_properties=self.config.disable_additional_properties,
            )
        return self._structured_output_manager

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        grammar=None,
        lora_request=None,
    ) -> str:
        """Queue a request; ``prompt`` is a string or ``{"prompt_token_ids": [...]}``/``{"prompt": str}``.
        ``params``: ``SamplingParams`` (generation), or ``PoolingParams`` for a pooling request (an
        embedding: its prompt runs once, and one ``PoolingRequestOutput`` comes when it did; see
        ``_add_pooling_request``).

        With ``params.structured_outputs``, ``grammar`` is its matcher (from
        ``structured_output_manager.compile_await``, so that a server compiles off the step loop); None
        compiles it here.

        Raises InvalidRequestError (a ValueError naming the field; nothing is queued) for an empty prompt,
        token ids outside the vocabulary (in the prompt, ``logit_bias``, ``allowed_token_ids`` or
        ``bad_words``), a prompt that leaves no room in ``max_model_len``, one that cannot fit even in the
        empty pool (with its LoRA adapter's pages), a ``request_id`` in use, a constraint that does not
        compile, or a ``lora_request``
        (``rawpaged.lora.request.LoRARequest``: the adapter it runs with) without ``enable_lora`` or whose
        adapter cannot be loaded (param "lora_request", the message naming the adapter and the field).
        """
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(prompt, params, request_id, lora_request)
        params = params or SamplingParams()
        manager = self.runner.lora_manager
        lora = self.input_processor.check_lora_request(lora_request, manager)
        pages = manager.num_pages(lora.request.lora_int_id) if lora is not None else 0
        text, ids = self.input_processor.process(prompt, params, lora_pages=pages)
        request_id = str(request_id) if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        rules = logits_rules(params, ids, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.structured_output_manager.compile(params.structured_outputs)
        req = Request(request_id, text, ids, params, time.monotonic(), logits_rules=rules, lora_request=lora_request)
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, params, self._seq_rng(params, 0), req.arrival_time)
        if lora is not None:  # its lora_key (the adapter's digest) is set when the scheduler admits it
            seq.lora_int_id = lora.request.lora_int_id
        seq.grammar = grammar if params.structured_outputs is not None else None
        if seq.grammar is not None and self.reasoning_end_token_id is not None:  # as vLLM: ended if in the prompt
            seq.reasoning_ended = self.reasoning_end_token_id in ids
        req.seqs.append(seq)
        if params.use_beam_search:
            req.beam = beam_search.BeamState(params.beam_width, params.length_penalty)
            req.beams = [seq]
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _add_pooling_request(self, prompt, params: PoolingParams, request_id, lora_request) -> str:
        """Queue a pooling request (``add_request`` with ``PoolingParams``). Raises InvalidRequestError for
        an empty prompt, ids outside the vocabulary, a prompt over ``max_model_len`` tokens or over the
        empty pool (param "prompt"), ``dimensions`` the model does not take (``Pooling.check``), a
        ``request_id`` in use, or a bad ``lora_request``."""
        params = self.pooling.check(params)
        text, ids = self.input_processor.process_pooling(prompt)
        lora = self.input_processor.check_lora_request(lora_request, self.runner.lora_manager)
        request_id = str(request_id) if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        sp = POOLING_SAMPLING_PARAMS
        req = Request(request_id, text, ids, sp, time.monotonic(), lora_request=lora_request)
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, sp, None, req.arrival_time, pooling_params=params)
        if lora is not None:
            seq.lora_int_id, seq.lora_key = lora.id, lora.digest
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _seq_rng(self, params: SamplingParams, index: int) -> np.random.Generator:
        """Sample ``index``'s generator: from the request's seed, else from the engine's generator."""
        seed = params.seed
        return np.random.default_rng([seed, index] if seed is not None else self._rng.integers(1 << 62))

    def _fork(self, req: Request, parent: Sequence, index: int | None = None) -> Sequence:
        """A new sequence of ``req`` continuing from ``parent`` and sharing its blocks."""
        index = len(req.seqs) if index is None else index
        child = parent.fork(next(self._seq_ids), index, self._seq_rng(req.params, index))
        req.seqs.append(child)
        self.scheduler.fork(parent, child)
        return child

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks return to the pool. False if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish_seqs(req.seqs, "abort")
        return True

    # ---------------------------------------------------------------------- LoRA adapters
    def add_lora(self, lora_request) -> bool:
        """Register an adapter (checked from its config and weights header; loaded when a request needs
        it), as vLLM's ``add_lora``; True. Raises InvalidRequestError as ``add_request`` for its
        ``lora_request``."""
        self.input_processor.check_lora_request(lora_request, self.runner.lora_manager)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its pool pages, host copy and slot (vLLM's ``remove_lora``). False if it is not
        registered. Raises ValueError while an unfinished request uses it (finish or abort them first)."""
        manager = self.runner.lora_manager
        if manager is None or lora_int_id not in manager.specs:
            return False
        users = [r.request_id for r in self.requests.values() if any(s.lora_int_id == lora_int_id for s in r.seqs)]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {len(users)} unfinished requests")
        self.kv_cache_manager.adapter_pages.evict(lora_int_id)
        return manager.remove_adapter(lora_int_id)

    def list_loras(self) -> dict:
        """``{lora_int_id: LoRARequest}`` of the registered adapters (empty without LoRA)."""
        manager = self.runner.lora_manager
        return manager.list_adapters() if manager is not None else {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def warmup(self) -> float:
        """Run the warm-up requests (``rawpaged.engine.warmup``: every kernel variant this configuration can
        call is compiled, or loaded from its cache, before serving), then reset the counters ``stats``
        reports. Call with no requests queued (else RuntimeError). Returns the seconds taken."""
        seconds = run_warmup(self)
        self.kv_cache_manager.reset_stats()
        self.scheduler.stats = SchedulerStats()
        if self.speculator is not None:
            self.speculator.reset_stats()
        return seconds

    # ---------------------------------------------------------------------- step
    def step(self) -> list:
        """Run one iteration; returns a ``RequestOutput`` for each request that produced tokens or finished,
        then a ``PoolingRequestOutput`` for each pooling request whose prompt finished.

        A failure while computing one request's part of the step (its samples, forks, beams, text or
        output) ends that request alone: its blocks are freed and its output carries ``error``; the other
        requests' outputs are those of a step without it. A failure of the batch itself (the forward pass)
        propagates.
        """
        failed = self._fail_lora_loads()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:  # a swap-in runs no tokens until the next step; its copies run now
            self.runner.run_kv_transfers(sched_out.kv_transfers)
            self.scheduler.update_from_output(sched_out, [])
            if self.scheduler.num_waiting_for_lora and not self.scheduler.running:
                self.runner.lora_manager.wait_for_loads(0.01)  # nothing else to run: let a load finish
            return failed
        logits, layout, scored, pooled = self.runner.execute_model(sched_out)
        for seq, (first, entries) in scored.items():
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            if first == len(seq.prompt_logprobs):
                seq.prompt_logprobs += prompt_logprob_entries(entries, self.tokenizer)
        now = time.monotonic()
        selected = self.token_selector.select(logits, layout, self.requests, now)
        self._update_sequences(sched_out, selected, now)
        pooled_outputs = finish_pooled(self, pooled)
        if self.speculator is not None:
            self._speculate(selected)
        return failed + self._make_outputs(selected) + pooled_outputs

    def _fail_lora_loads(self) -> list:
        """End the waiting requests whose adapter failed to load in the background (its files changed or
        vanished after it was registered): a finished output with ``error`` each."""
        manager = self.runner.lora_manager
        if manager is None:
            return []
        errors = manager.take_failed_loads()
        if not errors:
            return []
        failed = {s.request_id: errors[s.lora_int_id] for s in self.scheduler.waiting if s.lora_int_id in errors}
        return [self._fail_request(rid, e) for rid, e in failed.items() if rid in self.requests]

    def _speculate(self, selected: SelectedTokens) -> None:
        """Record this step's verified drafts and finished outputs, then draft for the next step."""
        spec = self.speculator
        for seq, num_drafts, num_accepted in selected.verified:
            spec.observe(seq, num_drafts, num_accepted)
        for req in selected.touched.values():
            if req.finished:
                for seq in req.seqs:
                    spec.finished(seq)
        spec.propose(self.scheduler.running)

    def _update_sequences(self, sched_out, selected: SelectedTokens, now: float) -> None:
        """Append the selected tokens, drop pruned and finished beams, and stop the sequences whose
        output processing (stop strings, texts) ends them; a failure there fails its request alone."""
        failed = selected.failed
        before = {seq: len(seq.output_token_ids) for seq, _, _ in selected.samples}
        self.scheduler.update_from_output(
            sched_out, [(seq, tok) for seq, tok, _ in selected.samples] + selected.beam_sampled
        )
        selected.samples = _appended(selected.samples, before)
        self.scheduler.finish_seqs(selected.pruned, "beam_pruned")
        for req in selected.beams_done:
            self.scheduler.finish_seqs(req.beams, "beam_done")
            req.beams = []
        by_request: dict[str, list] = {}
        for sample in selected.samples:
            by_request.setdefault(sample[0].request_id, []).append(sample)
        stopped = []
        processor = self.output_processor
        dropped = processor.num_dropped_tokens
        for rid, group in by_request.items():
            try:
                stopped += processor.process_tokens(group, now)
            except Exception as e:  # noqa: BLE001
                failed[rid] = e
        self.scheduler.stats.num_generation_tokens -= processor.num_dropped_tokens - dropped
        if stopped:
            self.scheduler.finish_seqs([s for s in stopped if s.request_id not in failed], "stop")

    def _make_outputs(self, selected: SelectedTokens) -> list:
        """A ``RequestOutput`` per touched request (finished ones leave ``requests``), then one per failed
        request (its blocks freed, ``error`` set)."""
        outputs, failed = [], selected.failed
        for req in selected.touched.values():
            if req.request_id in failed:
                continue
            try:
                out = self.output_processor.make_output(req)
            except Exception as e:  # noqa: BLE001
                failed[req.request_id] = e
                continue
            outputs.append(out)
            if out.finished:
                del self.requests[out.request_id]
        return outputs + [self._fail_request(rid, e) for rid, e in failed.items()]

    def _fail_request(self, request_id: str, error: Exception) -> RequestOutput:
        """End a request whose computation failed: its blocks back, a finished output with ``error``."""
        req = self.requests.pop(request_id)
        self.scheduler.finish_seqs(req.seqs, "abort")
        logger.error("request %s failed in a step and was ended; the others go on", request_id, exc_info=error)
        return RequestOutput(
            request_id,
            req.prompt,
            req.prompt_token_ids,
            [],
            True,
            req.seqs[0].num_cached_tokens,
            {"arrival_time": req.arrival_time, "finished_time": time.monotonic()},
            error=f"{type(error).__name__}: {error}",
        )

    # --------------------------------------------------------------------- stats
    def kv_cache_state(self, start: int = 0, count: int | None = None, since_event: int | None = None):
        """A copy of the KV block pool's state between steps (``rawpaged.core.kv_cache_snapshot.capture``;
        ``to_json`` makes the snapshot). Raises ValueError for a bad block range."""
        return kv_cache_snapshot.capture(self.scheduler, start, count, since_event)

    def stats(self) -> dict:
        """Pool, cache and scheduler counters. ``num_running``/``num_waiting`` count sequences (n > 1 and
        beams have several per request); ``num_requests_running`` counts requests with a sequence in the
        running batch, ``num_requests_waiting`` the others not finished. ``kv_cache_groups``: the pool's KV
        cache groups with the blocks each holds (``kv_cache_snapshot.groups_summary``); ``kv_block_bytes``:
        the bytes of one block (its group's layers, K and V)."""
        kv = self.kv_cache_manager
        pool = kv.block_pool
        sched = self.scheduler
        running_requests = {s.request_id for s in sched.running}
        return {
            "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_used_blocks,
            "num_shared_blocks": pool.num_shared_blocks,
            "num_cached_blocks": pool.num_cached_free_blocks,
            "kv_cache_usage": pool.usage(),
            "block_size": kv.block_size,
            "num_preemptions": sched.stats.num_preemptions,
            "num_cow_copies": pool.num_cow_copies,
            "peak_used_blocks": pool.peak_used_blocks,
            "prefix_cache_queries": kv.num_prefix_queries,
            "prefix_cache_hits": kv.num_prefix_hits,
            "num_running": len(sched.running),  # sequences
            "num_waiting": len(sched.waiting),
            "num_requests_running": len(running_requests),
            "num_requests_waiting": len({s.request_id for s in sched.waiting} - running_requests),
            "prompt_tokens_total": sched.stats.num_prompt_tokens,
            "generation_tokens_total": sched.stats.num_generation_tokens,
            "num_steps": sched.stats.num_steps,
            "num_swapped_out": sched.stats.num_swapped_out,
            "num_swapped_in": sched.stats.num_swapped_in,
            "num_window_frees": kv.num_window_frees,
            "kv_block_bytes": self.kv_block_bytes,
            "num_kv_cache_groups": kv.num_groups,
            "kv_cache_groups": kv_cache_snapshot.groups_summary(kv, sched.running),
            **self._spec_decode_stats(),
            **self._offload_stats(),
            **self._lora_stats(),
            **lora_stats(self.runner.lora_manager, sched.running, self.requests),
        }

    def _lora_stats(self) -> dict:
        """LoRA's counters (``lora_*``; zeros without LoRA): adapters resident in the pool and the blocks
        (pages) they hold, adapters paged in and evicted, adapters read from disk, host copies kept and
        dropped (``max_cpu_loras``), loads under way, and requests waiting for their adapter's load."""
        pages = self.kv_cache_manager.adapter_pages
        manager = self.runner.lora_manager
        cache = manager.cpu_cache if manager is not None else None
        waiting = {s.request_id for s in self.scheduler.waiting if s.status is SequenceStatus.WAITING_FOR_LORA}
        return {
            "lora_adapters_resident": pages.num_resident,
            "lora_adapter_pages": pages.num_pages,
            "lora_pool_loads": pages.stats.num_loads,
            "lora_evictions": pages.stats.num_evictions,
            "lora_loads": cache.num_loads if cache is not None else 0,
            "lora_adapters_cpu": len(cache) if cache is not None else 0,
            "lora_cpu_evictions": cache.num_evictions if cache is not None else 0,
            "lora_loading": cache.num_pending if cache is not None else 0,
            "num_requests_waiting_for_lora": len(waiting),
        }

    def _spec_decode_stats(self) -> dict:
        """Speculative decoding's counters, whole (``spec_decode``; None when off) and flat (``/metrics``)."""
        spec = self.speculator.stats.as_dict() if self.speculator is not None else None
        flat = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return {"spec_decode": spec, **{f"spec_decode_{k}": spec[k] if spec else 0 for k in flat}}

    def _offload_stats(self) -> dict:
        """The second KV tier's counters, flat (``/metrics``) and whole (``kv_offload``; None without one)."""
        tier = self.kv_offload.stats() if self.kv_offload is not None else None
        if tier is None:
            return {"kv_offload": None}
        return {
            "kv_offload": tier,
            "num_offload_slots": tier["num_slots"],
            "num_offloaded_blocks": tier["num_prefix_blocks"],
            "num_swapped_blocks": tier["num_swap_blocks"],
            "offload_prefix_hits": tier["prefix_hits"],
            "offload_prefix_stores": tier["prefix_stores"],
        }

    def close(self) -> None:
        """Flush and release what outlives a step: the second KV tier's file. Idempotent."""
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None


def _appended(samples: list, before: dict) -> list:
    """The ``(sequence, token, logprobs row)`` samples the scheduler appended (``before``: each sequence's
    output length before): a speculative step's tokens after its stop (EOS, a stop token id, a length
    limit) are dropped, so their logprobs go with them."""
    left = {seq: len(seq.output_token_ids) - n for seq, n in before.items()}
    kept = []
    for sample in samples:
        if left[sample[0]] > 0:
            left[sample[0]] -= 1
            kept.append(sample)
    return kept
