"""Continuous-batching scheduler: decides which sequences run each step and reserves their KV slots.

One token budget per step (``max_num_batched_tokens``) is shared by decodes, prefills and prefill
chunks, as in vLLM v1's scheduler and Orca's iteration-level scheduling (Yu et al., OSDI 2022).
Running sequences are served first, in arrival order; waiting ones are admitted FCFS while the
budget, ``max_num_seqs`` and the block pool allow. When the pool runs dry, the newest running
sequence is preempted by recompute (vLLM paper §4.5): its blocks are freed and it re-enters the head
of the waiting queue with ``num_computed_tokens = 0``.

An optional ``admission_policy`` (default None: plain paged admission) can refuse admissions on top
of the block check, e.g. ``ReservationAdmission``, which emulates servers that reserve a request's
whole KV footprint (``max_model_len`` or prompt + ``max_tokens``) up front. A policy provides
``can_admit(seq) -> bool``, ``admitted(seq)`` and ``released(seq)`` (finished or preempted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rawpaged.block_allocator import BlockAllocator
from rawpaged.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """``scheduled``: (sequence, number of new tokens to compute this step), running order."""

    scheduled: list = field(default_factory=list)
    preempted: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ReservationAdmission:
    """Admit a waiting sequence only if its whole footprint, ``reserve_tokens(seq)`` slots, can be
    reserved up front: the free blocks, less the blocks still promised to admitted sequences (their
    reservation minus the blocks they already hold), must cover ``ceil(reserve_tokens(seq) /
    block_size)``. Blocks stay paged (no external fragmentation); only the admission is contiguous-style.
    Reserves for the admitted sequence only (forked samples are not reserved for).
    """

    def __init__(self, allocator: BlockAllocator, reserve_tokens: Callable[[Sequence], int]):
        self.allocator = allocator
        self.reserve_tokens = reserve_tokens
        self._reserved: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, reserved blocks)

    def blocks_for(self, seq: Sequence) -> int:
        return -(-self.reserve_tokens(seq) // self.allocator.block_size)

    @property
    def outstanding_blocks(self) -> int:
        """Blocks promised to admitted sequences but not yet allocated to them."""
        return sum(max(0, n - (len(s.block_table.block_ids) if s.block_table is not None else 0))
                   for s, n in self._reserved.values())

    def can_admit(self, seq: Sequence) -> bool:
        return self.allocator.num_free_blocks - self.outstanding_blocks >= self.blocks_for(seq)

    def admitted(self, seq: Sequence) -> None:
        self._reserved[seq.seq_id] = (seq, self.blocks_for(seq))

    def released(self, seq: Sequence) -> None:
        self._reserved.pop(seq.seq_id, None)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_policy=None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admission_policy = admission_policy  # None: admit whenever the prompt's blocks fit

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds computed KV (a fork of a running one) joins the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove ``seq`` (running or waiting) and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.admission_policy is not None:
            self.admission_policy.released(seq)
        if seq.block_table is not None:
            self.allocator.free(seq.block_table)
            seq.block_table = None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        alloc = self.allocator

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:  # a beam waiting for its siblings' logits: nothing to compute
                i += 1
                continue
            while not alloc.allocate_slots(seq.block_table, n):
                victims = self._preempt_newest(out)
                if seq in victims:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i = self.running.index(seq) + 1  # a preempted beam group may have stood before seq

        if out.preempted:
            return out  # no admissions in a step that had to preempt

        slots = sum(map(_seq_slots, self.running))  # batch slots taken, counting forks still to come
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.output_token_ids and seq.sampling_params.use_beam_search:
                if not self._admit_beam_group(seq, out):
                    break
                budget = self.max_num_batched_tokens - out.num_batched_tokens
                slots = sum(map(_seq_slots, self.running))
                continue
            if slots + _seq_slots(seq) > self.max_num_seqs and self.running:
                break
            if self.admission_policy is not None and not self.admission_policy.can_admit(seq):
                break
            table = alloc.new_table()
            token_ids = seq.token_ids
            bs = alloc.block_size
            # At least the last token is always computed, so there is a logit to sample from.
            cached = alloc.find_cached_prefix(token_ids, max_blocks=(len(token_ids) - 1) // bs)
            alloc.attach_cached_prefix(table, cached)
            num_cached = len(cached) * bs
            n = min(len(token_ids) - num_cached, budget)
            if not alloc.allocate_slots(table, n):
                alloc.free(table)
                break
            self.waiting.popleft()
            seq.block_table = table
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
        return out

    def _preempt_newest(self, out: SchedulerOutput) -> list:
        """Preempt the newest running sequence; a beam takes its running siblings with it, since beams
        advance together and a lone beam would hold blocks while waiting for the others."""
        victim = self.running[-1]
        if victim.sampling_params.use_beam_search:
            victims = [s for s in self.running if s.request_id == victim.request_id]
        else:
            victims = [victim]
        for v in reversed(victims):  # appendleft in reverse keeps the group's order at the queue head
            self.running.remove(v)
            self._preempt(v)
        out.scheduled[:] = [(s, n) for s, n in out.scheduled if s not in victims]
        out.preempted.extend(victims)
        return victims

    def _admit_beam_group(self, head: Sequence, out: SchedulerOutput) -> bool:
        """Admit all waiting beams of ``head``'s request together (recompute), or none. Blocks for all
        their tokens must be free; their prefill may still be chunked over several steps."""
        group = [s for s in self.waiting if s.request_id == head.request_id]
        alloc = self.allocator
        if sum(-(-s.num_tokens // alloc.block_size) for s in group) > alloc.num_free_blocks:
            return False
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        for s in group:
            self.waiting.remove(s)
            s.block_table = alloc.new_table()
            s.num_computed_tokens = 0
            n = min(s.num_tokens, budget)
            assert alloc.allocate_slots(s.block_table, n)
            s.status = SequenceStatus.RUNNING
            self.running.append(s)
            if n:
                out.scheduled.append((s, n))
                budget -= n
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.admission_policy is not None:
            self.admission_policy.released(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = None
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _seq_slots(seq: Sequence) -> int:
    """Batch slots a sequence will take: a request's first sequence, before its first token, forks into
    ``best_of`` samples or ``beam_width`` beams right after its prefill; any other takes one."""
    if seq.index == 0 and not seq.output_token_ids:
        return max(seq.sampling_params.best_of, seq.sampling_params.beam_width or 1)
    return 1
