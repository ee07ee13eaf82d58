"""Continuous-batching scheduler: which sequences run each step, their KV slots, and what a step's
sampled tokens do to them.

One token budget per step (``max_num_batched_tokens``) is shared by decodes, prefills and prefill
chunks, as in vLLM v1's scheduler and Orca's iteration-level scheduling (Yu et al., OSDI 2022).
Running sequences are served first, in arrival order; waiting ones are admitted FCFS while the
budget, ``max_num_seqs`` and the block pool allow. In a step that carries decodes, prefill tokens
(new prompts and chunks of running ones) are capped by ``max_prefill_tokens_while_decoding``, so a
prompt arriving while others decode is chunked instead of stalling them for its whole prefill
(Sarathi-Serve's stall-free batching, Agrawal et al., OSDI 2024); a step without decodes takes the
whole budget, so a burst of arrivals is prefilled at once. When the pool runs dry, the newest running
sequence is preempted (vLLM paper §4.5) and re-enters the head of the waiting queue. By recompute: its
blocks are freed and it starts again from ``num_computed_tokens = 0``. By swapping (``preemption_mode``
"swap", with a second KV tier): the running sequences of its request are swapped out together, their blocks
copied to the tier once each, and swapped back in together before any other admission, as they were. The
rule: swap when the tier has room for the request's blocks, else recompute (a recompute needs no room
anywhere); both are counted.

After the model ran, ``update_from_output`` advances ``num_computed_tokens``, caches newly full blocks,
appends the sampled tokens and applies the token-level stop checks; finished sequences return their
blocks at once. Every block goes back through this class (``finish_seqs``), whatever ended the sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.kv_events import PREEMPT
from rawpaged.core.kv_offload import KVTransfers
from rawpaged.core.kv_tier import KVTier
from rawpaged.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: ``(sequence, number of new tokens to compute)`` in running order.
        preempted: sequences preempted (by recompute or swapping) to make room this step.
        blocks_to_copy: copy-on-write ``(src, dst)`` block copies to run before the step's kernels.
        kv_transfers: copies between the pool and the second KV tier, run before those
            (``kv_offload.KVTransfers``, from the ``KVTier``).
        spec_token_ids: ``seq_id -> drafts`` of the decoding sequences that verify drafts this step; such
            a sequence is scheduled for ``1 + len(drafts)`` tokens: its last token, then the drafts.
        lora_pages: ``lora_int_id -> (epoch, block ids)`` of the pool pages of each LoRA adapter the
            scheduled sequences use (``adapter_pages.AdapterPages.pages``; empty without a ``lora_source``).
    """

    scheduled: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    blocks_to_copy: list = field(default_factory=list)
    kv_transfers: KVTransfers = field(default_factory=lambda: KVTransfers([], []))
    spec_token_ids: dict = field(default_factory=dict)
    lora_pages: dict = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start-up (or the last reset): steps run, preemptions, prompt tokens computed
    (recomputation after preemption not counted), tokens generated."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_swapped_out: int = 0  # sequences preempted by swapping (the rest of num_preemptions: recompute)
    num_swapped_in: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class AdmissionPolicy(Protocol):
    """A hook that can refuse admissions on top of the block check (the memory study's reservation
    baselines live in ``benchmarks/``). ``released`` is called when an admitted sequence finishes or is
    preempted."""

    def can_admit(self, seq: Sequence) -> bool: ...

    def admitted(self, seq: Sequence) -> None: ...

    def released(self, seq: Sequence) -> None: ...


class LoRAAdapterSource(Protocol):
    """Where the scheduler learns about LoRA adapters (``rawpaged.lora.models.LoRAModelManager``):
    ``ready`` says whether an adapter's weights are loaded (with ``load``, asking for the load if not;
    never blocking), ``num_pages`` how many pool blocks it takes, ``lora_key`` its content digest (the
    prefix cache's key)."""

    def ready(self, lora_int_id: int, load: bool = True) -> bool: ...

    def num_pages(self, lora_int_id: int) -> int: ...

    def lora_key(self, lora_int_id: int) -> str: ...


class Scheduler:
    """Args:
        kv_cache_manager: the block pool's manager (the scheduler's only access to blocks).
        max_num_seqs: sequences per step at most (forks a request will make count from its admission).
        max_num_batched_tokens: tokens computed per step at most.
        max_model_len: a sequence finishes ("length") when it holds this many tokens.
        eos_token_ids: token ids that finish a sequence ("stop") unless its ``ignore_eos``.
        admission_policy: optional ``AdmissionPolicy``.
        max_prefill_tokens_while_decoding: prefill tokens per step at most while any running sequence
            decodes (None: only ``max_num_batched_tokens`` limits them).
        preemption_mode: "recompute", or "swap" (with ``kv_tier``; recompute where the tier has no room).
        kv_tier: the second KV tier beside ``kv_cache_manager``'s pool (``KVTier``), or None.
        max_loras: LoRA adapters the running sequences use at most (``Sequence.lora_int_id``); a waiting
            sequence whose adapter would be one more is passed over, keeping its place (vLLM's rule); None:
            no limit.
        lora_source: the adapters' ``LoRAAdapterSource``, or None (adapters then take no pool pages). With
            one, a waiting sequence whose adapter is not loaded yet is passed over, keeping its place
            (``SequenceStatus.WAITING_FOR_LORA``), and one admitted holds its adapter's pages in the pool
            (``KVCacheManager.adapter_pages``) while it runs.
    Raises:
        ValueError: a limit below 1, or an unknown ``preemption_mode``.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids=(),
        admission_policy: AdmissionPolicy | None = None,
        max_prefill_tokens_while_decoding: int | None = None,
        preemption_mode: str = "recompute",
        kv_tier: KVTier | None = None,
        max_loras: int | None = None,
        lora_source: LoRAAdapterSource | None = None,
    ):
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_prefill_tokens_while_decoding is not None and max_prefill_tokens_while_decoding < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {max_prefill_tokens_while_decoding}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.preemption_mode = preemption_mode
        self.kv_cache_manager = kv_cache_manager
        self.kv_tier = kv_tier
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.eos_token_ids = frozenset(eos_token_ids)
        self.admission_policy = admission_policy
        self.max_loras = max_loras
        self.lora_source = lora_source
        self._lora_holders: set = set()  # seq_ids of the sequences holding their adapter's pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_for_lora(self) -> int:
        """Waiting sequences passed over because their adapter is still loading."""
        return sum(1 for s in self.waiting if s.status is SequenceStatus.WAITING_FOR_LORA)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (from ``parent.fork``) shares ``parent``'s blocks and joins the running batch. Called
        when ``parent`` samples, so its KV covers all its tokens by the end of the step."""
        self.kv_cache_manager.fork(parent, child)
        if parent.seq_id in self._lora_holders:
            self._hold_lora([child])
        child.num_computed_tokens = parent.num_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish_seqs(self, seqs, reason: str) -> None:
        """End ``seqs`` (running or waiting; already finished ones are skipped) with ``finish_reason``
        ``reason`` and return their blocks at once."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            if self.admission_policy is not None:
                self.admission_policy.released(seq)
            self._drop_lora(seq)
            self.kv_cache_manager.free(seq)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        prefill_budget = budget
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running):
            prefill_budget = cap

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget) if remaining <= 1 else min(remaining, budget, prefill_budget)
            if n == 0:  # a beam waiting for its siblings' logits, or a prefill chunk past the cap
                i += 1
                continue
            drafted = self._schedule_drafts(seq, budget, out) if remaining == 1 else 0
            if drafted:
                budget -= drafted
                i += 1
                continue
            while not kv.allocate_slots(seq, n):
                victims = self._preempt_newest(out)
                if seq in victims:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                if remaining > 1:
                    prefill_budget -= n
                i = self.running.index(seq) + 1  # a preempted beam group may have stood before seq

        self._prefetch_loras()
        if not out.preempted:  # no admissions in a step that had to preempt
            self._admit(out, min(budget, prefill_budget))
        if out.scheduled:
            self.stats.num_steps += 1
        out.blocks_to_copy = kv.take_block_copies()
        pages = kv.adapter_pages
        out.lora_pages = {s.lora_int_id: pages.pages(s.lora_int_id) for s, _ in out.scheduled if self._holds_lora(s)}
        if self.kv_tier is not None:
            out.kv_transfers = self.kv_tier.take_transfers()
        return out

    def _schedule_drafts(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule decoding ``seq`` with its drafts (``spec_token_ids``, as many as the budget allows) when
        the pool has their slots; returns the tokens scheduled, or 0 (nothing changed) when it has no
        drafts, no budget for one, or no free blocks for them: it then decodes alone, and the drafts never
        preempt anyone."""
        drafts = seq.spec_token_ids
        n = min(1 + len(drafts), budget)
        if n < 2 or not self.kv_cache_manager.allocate_slots(seq, n):
            return 0
        out.scheduled.append((seq, n))
        out.spec_token_ids[seq.seq_id] = drafts[: n - 1]
        return n

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order while they fit; one whose LoRA adapter would exceed
        ``max_loras`` is passed over for this step and keeps its place (vLLM's rule)."""
        skipped: list[Sequence] = []
        try:
            self._admit_in_order(out, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_in_order(self, out: SchedulerOutput, budget: int, skipped: list) -> None:
        kv = self.kv_cache_manager
        slots = sum(map(_seq_slots, self.running))  # batch slots taken, counting forks still to come
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._lora_fits(seq) or not self._lora_loaded(seq):
                skipped.append(self.waiting.popleft())
                continue
            if seq.swapped_table is not None:
                if not self._swap_in_group(seq, out):
                    return
                budget = min(budget, self.max_num_batched_tokens - out.num_batched_tokens)
                slots = sum(map(_seq_slots, self.running))
                continue
            if seq.output_token_ids and seq.sampling_params.use_beam_search:
                if not self._admit_beam_group(seq, out):
                    return
                budget = self.max_num_batched_tokens - out.num_batched_tokens
                slots = sum(map(_seq_slots, self.running))
                continue
            if slots + _seq_slots(seq) > self.max_num_seqs and self.running:
                return
            if self.admission_policy is not None and not self.admission_policy.can_admit(seq):
                return
            computed = kv.get_computed_blocks(seq, count=False)
            tier = self.kv_tier
            offloaded = tier.get_offloaded_blocks(seq, len(computed)) if tier is not None else []
            num_cached = (len(computed) + len(offloaded)) * kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            allocate = tier.allocate_slots if offloaded else kv.allocate_slots  # the tier loads its hits
            if not self._hold_lora([seq]):
                return
            if not allocate(seq, n, computed, offloaded):
                self._drop_lora(seq)
                return
            kv.count_prefix_lookup(seq, len(computed))  # once per admission, not per attempt
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if not seq.output_token_ids:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            slots += _seq_slots(seq)
            if self.admission_policy is not None:
                self.admission_policy.admitted(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _lora_loaded(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter can run: in the pool already, or loaded (else ``seq`` is marked
        ``WAITING_FOR_LORA``; ``_prefetch_loras`` asks for the loads); its ``lora_key`` is set then, before
        any prefix lookup."""
        lid, source = seq.lora_int_id, self.lora_source
        if source is None or not lid:
            return True
        if not (self.kv_cache_manager.adapter_pages.is_resident(lid) or source.ready(lid, load=False)):
            seq.status = SequenceStatus.WAITING_FOR_LORA
            return False
        seq.status = SequenceStatus.WAITING
        seq.lora_key = source.lora_key(lid)
        return True

    def _prefetch_loras(self) -> None:
        """Ask for the loads of the first ``max_loras`` (or 1) adapters the waiting queue needs that are not
        in the pool, so they are read while the queue ahead of them runs; their sequences show
        ``WAITING_FOR_LORA`` until loaded."""
        if self.lora_source is None:
            return
        pages, asked = self.kv_cache_manager.adapter_pages, {}
        for seq in self.waiting:
            lid = seq.lora_int_id
            if not lid or pages.is_resident(lid):
                continue
            if lid not in asked:
                if len(asked) >= (self.max_loras or 1):
                    break
                asked[lid] = self.lora_source.ready(lid)
            seq.status = SequenceStatus.WAITING if asked[lid] else SequenceStatus.WAITING_FOR_LORA

    def _holds_lora(self, seq: Sequence) -> bool:
        return seq.seq_id in self._lora_holders

    def _hold_lora(self, seqs) -> bool:
        """Each of ``seqs`` (of one adapter) holds its adapter's pool pages, taken now if the adapter is not
        resident (idle adapters evicted for them); False, holding nothing, when the pool has no room."""
        seqs = [s for s in seqs if s.lora_int_id and self.lora_source is not None and not self._holds_lora(s)]
        pages = self.kv_cache_manager.adapter_pages
        for i, s in enumerate(seqs):
            if not pages.acquire(s.lora_int_id, self.lora_source.num_pages(s.lora_int_id)):
                for held in seqs[:i]:
                    self._drop_lora(held)
                return False
            self._lora_holders.add(s.seq_id)
        return True

    def _drop_lora(self, seq: Sequence) -> None:
        """``seq`` no longer runs: it lets go of its adapter's pages (idle at no user: kept, evictable)."""
        if seq.seq_id in self._lora_holders:
            self._lora_holders.discard(seq.seq_id)
            self.kv_cache_manager.adapter_pages.release(seq.lora_int_id)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether running ``seq`` keeps the running sequences' adapters within ``max_loras``."""
        if self.max_loras is None or not seq.lora_int_id:
            return True
        running = {s.lora_int_id for s in self.running if s.lora_int_id}
        return seq.lora_int_id in running or len(running) < self.max_loras

    def _preempt_newest(self, out: SchedulerOutput) -> list:
        """Preempt the newest running sequence; a beam takes its running siblings with it, since beams
        advance together and a lone beam would hold blocks while waiting for the others. Swapping takes
        the request's running sequences together (their shared blocks are copied once)."""
        victim = self.running[-1]
        group = [s for s in self.running if s.request_id == victim.request_id]
        swapped = self.preemption_mode == "swap" and self.kv_tier is not None and self.kv_tier.swap_out(group)
        if swapped:
            victims = group
        elif victim.sampling_params.use_beam_search:
            victims = group
        else:
            victims = [victim]
        for v in reversed(victims):  # appendleft in reverse keeps the group's order at the queue head
            self.running.remove(v)
            self._preempt(v, swapped)
        out.scheduled[:] = [(s, n) for s, n in out.scheduled if s not in victims]
        for v in victims:
            out.spec_token_ids.pop(v.seq_id, None)
        out.preempted.extend(victims)
        return victims

    def _admit_beam_group(self, head: Sequence, out: SchedulerOutput) -> bool:
        """Admit all waiting beams of ``head``'s request together (recompute), or none. Blocks for all
        their tokens must be free; their prefill may still be chunked over several steps."""
        group = [s for s in self.waiting if s.request_id == head.request_id]
        kv = self.kv_cache_manager
        if not self._hold_lora(group):
            return False
        if not kv.make_room(sum(kv.num_blocks_to_allocate(s, s.num_tokens) for s in group)):
            for s in group:
                self._drop_lora(s)
            return False
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        for s in group:
            self.waiting.remove(s)  # preempted: num_computed_tokens is 0
            n = min(s.num_tokens, budget)
            allocated = kv.allocate_slots(s, n)
            assert allocated, "the group's blocks were counted free"  # pragma: no mutate
            s.status = SequenceStatus.RUNNING
            self.running.append(s)
            if n:
                out.scheduled.append((s, n))
                budget -= n
        return True

    def _preempt(self, seq: Sequence, swapped: bool = False) -> None:
        """Back to the head of the waiting queue: swapped out (its blocks already in the tier), or for
        recompute (its blocks freed, ``num_computed_tokens`` 0)."""
        if self.admission_policy is not None:
            self.admission_policy.released(seq)
        self._drop_lora(seq)
        if seq.block_tables is not None:
            held = [b for blocks in self.kv_cache_manager.group_blocks(seq) for b in blocks]
            self.kv_cache_manager.events.record(PREEMPT, seq, block_ids=held)
        if swapped:
            self.stats.num_swapped_out += 1
        else:
            self.kv_cache_manager.free(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _swap_in_group(self, head: Sequence, out: SchedulerOutput) -> bool:
        """Swap ``head``'s request back in: all its swapped-out sequences together (they share blocks), when
        the pool holds their blocks plus one more block each in each KV cache group, so their next tokens
        fit. Their remaining tokens run from the next step (as running sequences)."""
        group = [s for s in self.waiting if s.request_id == head.request_id and s.swapped_table is not None]
        kv = self.kv_cache_manager
        if len(self.running) + len(group) > self.max_num_seqs and self.running:
            return False
        if not self._hold_lora(group):
            return False
        if not kv.make_room(KVTier.num_blocks_to_swap_in(group) + len(group) * kv.num_groups):
            for s in group:
                self._drop_lora(s)
            return False
        self.kv_tier.swap_in(group)
        for s in group:
            self.waiting.remove(s)
            s.status = SequenceStatus.RUNNING
            self.running.append(s)
            if self.admission_policy is not None:
                self.admission_policy.admitted(s)
        self.stats.num_swapped_in += len(group)
        return True

    # ------------------------------------------------------------------ after the step
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: list) -> list:
        """Apply a step's results.

        Advances ``num_computed_tokens`` of every scheduled sequence and caches its newly full blocks;
        appends each ``(sequence, token_id)`` of ``sampled_token_ids`` (scheduled sequences that reached
        their last token, and forks made this step; a sequence that verified drafts has its accepted
        tokens in order, and its rejected drafts' slots are freed); finishes a sequence whose token is EOS (unless
        ``ignore_eos``) or one of its ``stop_token_ids`` ("stop"), or that reached ``max_tokens`` or
        ``max_model_len`` tokens ("length"), and frees its blocks. The one place a step's tier transfers end
        (the runner has copied them): a step that ran no model is reported here too, with no tokens.

        Returns the sequences finished here, in ``sampled_token_ids`` order.
        """
        stats = self.stats
        kv = self.kv_cache_manager
        if self.kv_tier is not None:
            self.kv_tier.end_transfers()
        spec = scheduler_output.spec_token_ids
        for seq, n in scheduler_output.scheduled:
            if seq.seq_id in spec:  # advanced below, by its accepted tokens
                continue
            stats.num_prompt_tokens += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            seq.num_computed_tokens += n
            self._cache_full_blocks(seq)
        finished = []
        for seq, token in sampled_token_ids:
            if seq.is_finished:  # a token after this step's stop (speculative steps emit several)
                continue
            seq.output_token_ids.append(token)
            stats.num_generation_tokens += 1
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.finish_seqs((seq,), reason)
                finished.append(seq)
        for seq, _ in scheduler_output.scheduled:
            if seq.seq_id in spec and not seq.is_finished:
                # KV is valid for the last token and the accepted drafts: all appended tokens but the
                # newest, which the next step computes. Slots written for rejected drafts go back.
                seq.num_computed_tokens = seq.num_tokens - 1
                kv.free_rejected_slots(seq)
                self._cache_full_blocks(seq)
        return finished

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Make ``seq``'s newly full blocks findable; a write-through tier stores them."""
        cached = self.kv_cache_manager.cache_full_blocks(seq)
        if self.kv_tier is not None:
            self.kv_tier.blocks_cached(cached)

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        """ "stop" at EOS (unless ``ignore_eos``) or a stop token id once ``min_tokens`` tokens exist (as
        vLLM v1's ``check_stop``), else "length" at ``max_tokens`` or ``max_model_len``."""
        params = seq.sampling_params
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens and (
            (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return "stop"
        if num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None


def _seq_slots(seq: Sequence) -> int:
    """Batch slots a sequence will take: a request's first sequence, before its first token, forks into
    ``best_of`` samples or ``beam_width`` beams right after its prefill; any other takes one."""
    if seq.index == 0 and not seq.output_token_ids:
        return max(seq.sampling_params.best_of, seq.sampling_params.beam_width or 1)
    return 1
