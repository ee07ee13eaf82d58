"""The engine: requests in, one ``step()`` at a time (schedule -> run -> sample -> detokenize), outputs out.

``LLMEngine`` is the synchronous core that the server's async loop drives; ``LLM`` is the offline API
(``generate``, ``chat``, ``stats``), named after vLLM's.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rawpaged import beam_search
from rawpaged.block_allocator import BlockAllocator
from rawpaged.config import EngineConfig, resolve_dtypes
from rawpaged.kernels import get_backend
from rawpaged.loader import load_config, load_weights
from rawpaged.model_runner import ModelRunner, kv_block_bytes
from rawpaged.models.llama import LlamaModel
from rawpaged.sampler import draw_uniform, log_softmax, top_logprobs
from rawpaged.sampling_params import SamplingParams
from rawpaged.scheduler import Scheduler
from rawpaged.sequence import Sequence
from rawpaged.tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list | None = None  # per token: {token_id: logprob}
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    params: SamplingParams
    arrival_time: float
    seqs: list = field(default_factory=list)
    forked: bool = False
    beam: beam_search.BeamState | None = None
    beams: list = field(default_factory=list)  # running beams (Sequences), beam search only

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.best_of == 1)


def resolve_model_dir(model: str | None) -> Path:
    """None or the default model's name -> the prepared default directory; else a directory path."""
    from rawpaged import weights

    if model is None or model == weights.DEFAULT_MODEL:
        return weights.prepare() if not weights.is_prepared(weights.default_model_dir()) else weights.default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither {weights.DEFAULT_MODEL!r} nor a directory")
    return path


class LLMEngine:
    """Continuous-batching engine over the paged KV cache.

    Raises (constructor): ValueError for a bad model directory or configuration; RuntimeError when
    ``device="cuda"`` and no usable GPU exists.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = load_config(self.model_dir)
        mc = self.model_config
        self.tokenizer = Tokenizer(self.model_dir)
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.backend = get_backend(config.device)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.dtype, self.kv_cache_dtype = resolve_dtypes(config.dtype, config.kv_cache_dtype, self.backend.name,
                                                         mc.torch_dtype)
        weights = load_weights(self.model_dir, mc)
        self.model = LlamaModel(mc, weights, self.backend, dtype=self.dtype, max_position=self.max_model_len)
        del weights
        block_bytes = kv_block_bytes(mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim,
                                     _np_dtype(self.kv_cache_dtype))
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory or self._default_kv_memory()
            num_blocks = max(1, budget // block_bytes)
        self.kv_block_bytes = block_bytes
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, _np_dtype(self.kv_cache_dtype))
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(config.seed)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_steps = 0

    def _default_kv_memory(self) -> int:
        if self.backend.name == "cuda":
            return self.backend.kv_cache_budget(self.config.gpu_memory_utilization)
        return DEFAULT_CPU_KV_CACHE_MEMORY

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; ``prompt`` is a string or ``{"prompt_token_ids": [...]}``/``{"prompt": str}``.

        Raises ValueError (nothing is queued) for an empty prompt, token ids outside the vocabulary, a
        prompt that leaves no room in ``max_model_len``, or one that cannot fit even in the empty pool.
        """
        params = params or SamplingParams()
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(at least one token must remain for generation)")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = -(-total // self.config.block_size)
        if params.use_beam_search:  # beams run together; each may end up holding its own blocks
            need *= params.beam_width
        if need > self.allocator.num_blocks:
            raise ValueError(f"request needs {need} KV blocks ({total} tokens of block_size "
                             f"{self.config.block_size}"
                             f"{f' x beam_width {params.beam_width}' if params.use_beam_search else ''})"
                             f" but the pool has only {self.allocator.num_blocks}")
        request_id = str(request_id) if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = time.monotonic()
        req = Request(request_id, text, list(int(t) for t in ids), params, now)
        seq = self._new_seq(req, 0)
        req.seqs.append(seq)
        if params.use_beam_search:
            req.beam = beam_search.BeamState(params.beam_width, params.length_penalty)
            req.beams = [seq]
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'")

    def _new_seq(self, req: Request, index: int) -> Sequence:
        seed = req.params.seed
        rng = np.random.default_rng([seed, index] if seed is not None else self._rng.integers(1 << 62))
        return Sequence(next(self._seq_ids), req.request_id, index, req.prompt_token_ids, req.params, rng,
                        req.arrival_time)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks return to the pool. False if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def warmup(self) -> float:
        """Run two short requests (a 40-token prompt greedy, a 5-token one sampled; plain and tiled prefill,
        decode, device sampling) so every kernel is compiled or loaded from its cache before serving, then
        reset the counters ``stats`` reports. Call with no requests queued. Returns the seconds taken."""
        if self.requests:
            raise RuntimeError("warmup() needs an idle engine")
        t0 = time.monotonic()
        vocab = self.model_config.vocab_size
        for n, params in ((40, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
                          (5, SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_tokens=3, ignore_eos=True))):
            self.add_request({"prompt_token_ids": [(7 * i + 3) % vocab for i in range(n)]}, params)
        while self.has_unfinished_requests():
            self.step()
        a = self.allocator
        a.num_cow_copies = a.num_prefix_queries = a.num_prefix_hits = 0
        a.peak_used_blocks = a.num_used_blocks
        self.scheduler.num_preemptions = 0
        self.num_prompt_tokens_total = self.num_generation_tokens_total = self.num_steps = 0
        return time.monotonic() - t0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------------- step
    def step(self) -> list:
        """Run one iteration; returns a ``RequestOutput`` for each request that produced tokens or finished."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.num_steps += 1
        logits, sampling = self.runner.execute(sched.scheduled, self.allocator.drain_copies())
        for seq, n in sched.scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            if self.allocator.needs_caching(seq.block_table, seq.num_computed_tokens):
                self.allocator.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        touched = {}
        now = time.monotonic()
        full_rows = [row for row, seq in enumerate(sampling) if self._needs_distribution(seq.sampling_params)]
        rows = self.runner.fetch_rows(logits, full_rows)
        draws, appends = [], []  # one token per target sequence, all drawn in one backend call
        for row, seq in enumerate(sampling):
            req = self.requests[seq.request_id]
            if req.beam is not None:
                seq.pending_logprobs = log_softmax(rows[row])
                if all(b.pending_logprobs is not None for b in req.beams):
                    self._beam_step(req, now)
                    if req.beam.done:
                        touched[req.request_id] = req
                continue
            targets = [seq]
            if not req.forked and req.params.best_of > 1:  # n > 1: the prompt's KV is shared by forks
                targets += self._fork(req, seq)
            req.forked = True
            need_lp = req.params.logprobs is not None or req.params.best_of > req.params.n
            lp_row = log_softmax(rows[row]) if need_lp else None
            for target in targets:
                draws.append((row, req.params, draw_uniform(req.params, target.rng)))
                appends.append((target, lp_row))
            touched[req.request_id] = req
        for (target, lp_row), token in zip(appends, self.runner.sample(logits, draws)):
            self._append_token(target, int(token), lp_row, now)
        return [self._output(req) for req in touched.values()]

    @staticmethod
    def _needs_distribution(params: SamplingParams) -> bool:
        """Whether a row's whole distribution must reach the host (logprobs, best_of, beams); sampling
        itself runs on the backend and returns only ids."""
        return params.logprobs is not None or params.best_of > params.n or params.use_beam_search

    def _fork(self, req: Request, parent: Sequence) -> list:
        children = []
        for index in range(1, req.params.best_of):
            child = self._new_seq(req, index)
            req.seqs.append(child)
            child.block_table = self.allocator.fork(parent.block_table, share=self.config.enable_block_sharing)
            if child.block_table is None:  # no blocks to copy into: the child computes its prompt itself
                self.scheduler.add(child)
                continue
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _beam_step(self, req: Request, now: float) -> None:
        """Select the next beams; fork block tables for beams that branch, free those that die."""
        params, beams = req.params, req.beams
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        limit = min(params.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        rows = np.stack([b.pending_logprobs for b in beams])
        for b in beams:
            b.pending_logprobs = None
        chosen = beam_search.step(req.beam, [b.cumulative_logprob for b in beams],
                                  [b.output_token_ids for b in beams], rows, stop_ids, limit)
        # Every chosen (parent, token) gets a sequence: the parent itself the first time, a fork after.
        claimed, targets = set(), []
        for cand in chosen:
            parent = beams[cand.parent]
            if cand.parent not in claimed:
                claimed.add(cand.parent)
                targets.append((parent, cand))
                continue
            child = self._new_seq(req, len(req.seqs))
            # Without sharing (a measurement baseline) beams copy their blocks; if the pool cannot hold
            # the copy they share after all, since a beam cannot wait for a recompute.
            child.block_table = (self.allocator.fork(parent.block_table, share=self.config.enable_block_sharing)
                                 or self.allocator.fork(parent.block_table))
            child.num_computed_tokens = parent.num_computed_tokens
            child.output_token_ids = list(parent.output_token_ids)
            req.seqs.append(child)
            self.scheduler.add_running(child)
            targets.append((child, cand))
        for i, b in enumerate(beams):
            if i not in claimed:
                self.scheduler.finish(b, "beam_pruned")
        req.beams = []
        for seq, cand in targets:
            seq.output_token_ids.append(cand.token_id)
            seq.cumulative_logprob = cand.cumulative_logprob
            self.num_generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            req.beams.append(seq)
        if req.beam.done:
            for seq in req.beams:
                self.scheduler.finish(seq, "beam_done")
            req.beams = []

    def _beam_outputs(self, req: Request) -> list:
        stop_ids = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_token_ids)
        outputs = []
        for i, hyp in enumerate(req.beam.finished[: req.params.n]):
            outputs.append(CompletionOutput(
                index=i, text=self.tokenizer.decode(hyp.token_ids), token_ids=list(hyp.token_ids),
                finish_reason="stop" if hyp.token_ids[-1] in stop_ids else "length",
                cumulative_logprob=hyp.cumulative_logprob))
        return outputs

    def _append_token(self, seq: Sequence, token: int, lp_row, now: float) -> None:
        params = seq.sampling_params
        seq.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if lp_row is not None:
            seq.cumulative_logprob += float(lp_row[token])
            if params.logprobs is not None:
                seq.logprobs.append(top_logprobs(lp_row, token, params.logprobs))
        reason = None
        if token in self.eos_token_ids and not params.ignore_eos or token in params.stop_token_ids:
            reason = "stop"
        else:
            new_text = self.detokenizer.step(seq)
            if params.stop_strings and new_text:
                reason = self._check_stop_strings(seq, len(new_text))
        if reason is None and (len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if reason == "length":
                self._flush_text(seq)
            self.scheduler.finish(seq, reason)

    def _flush_text(self, seq: Sequence) -> None:
        """At the end, emit any text held back because it ended in an incomplete character."""
        ids = seq.output_token_ids
        tail = self.tokenizer.decode(ids[seq.prefix_offset:])
        head = self.tokenizer.decode(ids[seq.prefix_offset:seq.read_offset])
        seq.output_text += tail[len(head):]
        seq.prefix_offset = seq.read_offset = len(ids)

    @staticmethod
    def _check_stop_strings(seq: Sequence, num_new_chars: int) -> str | None:
        text = seq.output_text
        longest = max(len(s) for s in seq.sampling_params.stop_strings)
        # Only a match that ends inside the new text can be new.
        start = max(0, len(text) - num_new_chars - longest + 1)
        cut = None
        for s in seq.sampling_params.stop_strings:
            i = text.find(s, start)
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            seq.output_text = text[:cut]
            return "stop"
        return None

    def _visible_text(self, seq: Sequence) -> str:
        """Text safe to show: while running, hold back a tail that could begin a stop string."""
        stops = seq.sampling_params.stop_strings
        if seq.is_finished or not stops:
            return seq.output_text
        hold = max(len(s) for s in stops) - 1
        return seq.output_text[: max(seq.num_text_emitted, len(seq.output_text) - hold)]

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finished
        seqs = sorted(req.seqs, key=lambda s: s.index)
        if req.beam is not None:
            seqs = []
        elif req.params.best_of > req.params.n:
            if not finished:
                seqs = []
            else:  # the n best by cumulative logprob, renumbered
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: req.params.n]
        outputs = []
        for i, seq in enumerate(seqs):
            text = self._visible_text(seq)
            seq.num_text_emitted = len(text)
            outputs.append(CompletionOutput(
                index=i if req.params.best_of > req.params.n else seq.index, text=text,
                token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if req.params.logprobs is not None else None))
        if req.beam is not None and finished:
            outputs = self._beam_outputs(req)
        first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": first}
        if finished:
            self.requests.pop(req.request_id, None)
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished,
                             req.seqs[0].num_cached_tokens, metrics)

    # --------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Pool, cache and scheduler counters. ``num_running``/``num_waiting`` count sequences (n > 1 and
        beams have several per request); ``num_requests_running`` counts requests with a sequence in the
        running batch, ``num_requests_waiting`` the others not finished."""
        a = self.allocator
        running_requests = {s.request_id for s in self.scheduler.running}
        return {
            "num_total_blocks": a.num_blocks,
            "num_free_blocks": a.num_free_blocks,
            "num_used_blocks": a.num_used_blocks,
            "num_shared_blocks": a.num_shared_blocks,
            "num_cached_blocks": a.num_cached_free_blocks,
            "kv_cache_usage": a.usage(),
            "block_size": a.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_cow_copies": a.num_cow_copies,
            "peak_used_blocks": a.peak_used_blocks,
            "prefix_cache_queries": a.num_prefix_queries,
            "prefix_cache_hits": a.num_prefix_hits,
            "num_running": len(self.scheduler.running),  # sequences
            "num_waiting": len(self.scheduler.waiting),
            "num_requests_running": len(running_requests),
            "num_requests_waiting": len({s.request_id for s in self.scheduler.waiting} - running_requests),
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            "num_steps": self.num_steps,
        }


def _np_dtype(name: str):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class LLM:
    """Offline inference: ``LLM(model=None).generate(prompts, SamplingParams(...))``.

    Args mirror ``EngineConfig`` (model, device, block_size, num_kv_blocks, max_num_seqs, max_model_len,
    ...). Raises ValueError for bad configuration or model files.
    """

    def __init__(self, model: str | None = None, device: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 64, max_model_len: int | None = None,
                 **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, block_size=block_size,
                                             num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                             max_model_len=max_model_len, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params=None) -> list:
        """Generate for one prompt or a list; returns ``RequestOutput``s in input order.

        ``sampling_params`` is one ``SamplingParams`` for all or a list (one per prompt). If any prompt
        is invalid, a ValueError is raised and nothing is left queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def chat(self, messages, sampling_params=None) -> list:
        """Like ``generate`` for one conversation (list of {"role", "content"}) or a list of them,
        rendered with the model's chat template and ``add_generation_prompt=True``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params)

    def beam_search(self, prompts, beam_width: int = 4, max_tokens: int = 16, length_penalty: float = 1.0,
                    n: int | None = None, ignore_eos: bool = False) -> list:
        """Beam search for each prompt; ``outputs`` holds the ``n`` (default ``beam_width``) best
        hypotheses, best first (HF transformers' semantics, see ``rawpaged.beam_search``)."""
        params = SamplingParams(n=n or beam_width, beam_width=beam_width, max_tokens=max_tokens,
                                length_penalty=length_penalty, temperature=0.0, ignore_eos=ignore_eos)
        return self.generate(prompts, params)

    def stats(self) -> dict:
        return self.engine.stats()
