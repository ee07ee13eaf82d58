"""One model step's inputs, made once from the scheduler's output: the decode/prefill split, the flattened
token ids, positions and KV slots, the attention metadata and the layout of the logits rows that sample.

A decode computes exactly its sequence's last token, plus any drafts it verifies; every other scheduled
sequence is a prefill (or a chunk of one). Tokens are ordered decodes first, then prefills, in scheduled
order within each group. After vLLM v1's ``GPUModelRunner._prepare_inputs``, which makes the step's
inputs and its ``SpecDecodeMetadata`` once, and whose sampler reads the rows from the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.model_executor.models.llama import AttentionMetadata


@dataclass(frozen=True)
class LogitsLayout:
    """Which logits rows belong to which sequence in a step (the ``logits`` that ``execute_model``
    returns): the sequences that sample, in scheduled order, each with ``1 + len(drafts)`` consecutive
    rows, one per position it samples at (its last token, then each draft).

    seqs: the sampling sequences. draft_token_ids: per sequence, the drafts it verifies (``()`` for
    none). first_rows: per sequence, its first row. logits_indices: int64 ``[num_rows]``, the row of the
    step's hidden states each logits row is computed from.
    """

    seqs: tuple
    draft_token_ids: tuple
    first_rows: tuple
    logits_indices: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.logits_indices)

    def rows(self, i: int) -> range:
        """The logits rows of ``seqs[i]``."""
        return range(self.first_rows[i], self.first_rows[i] + 1 + len(self.draft_token_ids[i]))

    def by_seq(self):
        """``(first row, sequence, drafts)`` per sampling sequence, in order."""
        return zip(self.first_rows, self.seqs, self.draft_token_ids)


@dataclass(frozen=True)
class StepInput:
    """A step's model inputs on the host (see the module doc).

    decodes, prefills: ``((sequence, num_new_tokens), ...)``. has_drafts: some decode verifies drafts.
    input_ids, positions, slot_mapping: int64 ``[num_tokens]``, decodes' tokens first (``slot_mapping``:
    the first KV cache group's slots; ``group_slot_mappings``: each group's, the same shape).
    decode_context_lens: int32 ``[num_decode_tokens]``, what each decode row attends (its context and
    the new tokens up to its own). layout: the logits rows (``LogitsLayout``). lora_ids: int64
    ``[num_tokens]``, each token's adapter (its sequence's ``lora_int_id``, 0: none), or None when no
    token of the step has one.
    """

    decodes: tuple
    prefills: tuple
    has_drafts: bool
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    decode_context_lens: np.ndarray
    layout: LogitsLayout
    group_slot_mappings: tuple = ()
    lora_ids: np.ndarray | None = None

    @property
    def num_groups(self) -> int:
        """KV cache groups the step's sequences hold tables in."""
        return max(1, len(self.group_slot_mappings))

    @property
    def ordered(self) -> tuple:
        """The scheduled ``(sequence, num_new_tokens)`` in token order: decodes, then prefills."""
        return self.decodes + self.prefills

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_context_lens)

    def attention_metadata(self, backend, layer_groups: tuple = ()) -> AttentionMetadata:
        """The step's ``AttentionMetadata`` on ``backend``: the first KV cache group's, with every group's in
        ``groups`` and ``layer_groups`` (each layer's group index) so that ``layer(i)`` is layer i's. A
        sequence verifying k drafts is k + 1 decode rows over its one block table, row i attending its
        context plus the first i new tokens (causal, as its prefill would), since each layer writes every
        row's K and V before any row attends."""
        groups = tuple(self._group_metadata(backend, g) for g in range(self.num_groups))
        if len(groups) == 1:
            return groups[0]
        groups[0].groups, groups[0].layer_groups = groups, tuple(layer_groups)
        return groups[0]

    def _group_metadata(self, backend, group: int) -> AttentionMetadata:
        be, prefills = backend, self.prefills
        qsl = np.zeros(len(prefills) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum([n for _, n in prefills])
        slots = self.group_slot_mappings[group] if self.group_slot_mappings else self.slot_mapping
        return AttentionMetadata(
            slot_mapping=be.asarray(slots),
            num_decode_tokens=self.num_decode_tokens,
            decode_block_tables=be.asarray(_block_tables(self.decodes, lambda n: n, group)),
            decode_context_lens=be.asarray(self.decode_context_lens),
            prefill_block_tables=be.asarray(_block_tables(prefills, lambda n: 1, group)),
            query_start_loc=be.asarray(qsl),
            prefill_seq_lens=be.asarray(np.array([s.num_computed_tokens + n for s, n in prefills], dtype=np.int32)),
            max_query_len=max((n for _, n in prefills), default=0),
            max_context_len=int(self.decode_context_lens.max(initial=0)),
        )

    def device_inputs(self, backend, layer_groups: tuple = ()) -> tuple:
        """``(input_ids, positions, attention metadata)`` on ``backend``, as ``LlamaModel.forward`` takes them
        (``layer_groups``: each layer's KV cache group, see ``attention_metadata``)."""
        attn = self.attention_metadata(backend, layer_groups)
        return backend.asarray(self.input_ids), backend.asarray(self.positions), attn


def _block_tables(group: tuple, rows_each, kv_group: int = 0) -> np.ndarray:
    """int32 ``[sum(rows_each(n)), widest table]`` (at least one column, zero-padded): each sequence's
    block table of KV cache group ``kv_group`` repeated over its ``rows_each(n)`` rows."""
    width = max((len(s.block_tables[kv_group].block_ids) for s, _ in group), default=0)
    bt = np.zeros((sum(rows_each(n) for _, n in group), max(width, 1)), dtype=np.int32)
    row = 0
    for s, n in group:
        rows = rows_each(n)
        ids = s.block_tables[kv_group].block_ids
        bt[row : row + rows, : len(ids)] = ids
        row += rows
    return bt


def build_step_input(scheduler_output: SchedulerOutput) -> StepInput:
    """The ``StepInput`` of ``scheduler_output.scheduled`` = [(sequence, num_new_tokens)], with the drafts
    of ``spec_token_ids``: a decode's ids are its last token, then its drafts."""
    spec = scheduler_output.spec_token_ids
    decodes, prefills = [], []
    for s, n in scheduler_output.scheduled:
        decoding = s.num_computed_tokens == s.num_tokens - 1 and n == 1 + len(spec.get(s.seq_id, ()))
        (decodes if decoding else prefills).append((s, n))
    ordered = decodes + prefills
    num_groups = max((len(s.block_tables) for s, _ in ordered), default=1)
    ids, positions, slots = [], [], [[] for _ in range(num_groups)]
    for seq, n in ordered:
        start = seq.num_computed_tokens
        positions.extend(range(start, start + n))
        drafts = spec.get(seq.seq_id, ())
        ids.extend(seq.token_at(p) for p in range(start, start + n - len(drafts)))
        ids.extend(drafts)
        for g, table in enumerate(seq.block_tables):
            slots[g].extend(table.slots(start, start + n))
    decode_lens = [s.num_computed_tokens + i + 1 for s, n in decodes for i in range(n)]
    return StepInput(
        decodes=tuple(decodes),
        prefills=tuple(prefills),
        has_drafts=bool(spec),
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots[0], dtype=np.int64),
        decode_context_lens=np.array(decode_lens, dtype=np.int32),
        layout=_logits_layout(scheduler_output, ordered),
        group_slot_mappings=tuple(np.array(g, dtype=np.int64) for g in slots),
        lora_ids=_lora_ids(ordered),
    )


def _lora_ids(ordered: list) -> np.ndarray | None:
    """Each token's adapter id (``StepInput.lora_ids``), or None when no sequence has one."""
    if not any(s.lora_int_id for s, _ in ordered):
        return None
    return np.repeat(np.array([s.lora_int_id for s, _ in ordered], dtype=np.int64), [n for _, n in ordered])


def _logits_layout(scheduler_output: SchedulerOutput, ordered: list) -> LogitsLayout:
    """The sequences whose scheduled tokens reach their end (with drafts: their last draft) sample,
    from the hidden rows of their last ``1 + len(drafts)`` new tokens; a pooling sequence never samples."""
    spec = scheduler_output.spec_token_ids
    last_row, row = {}, 0
    for seq, n in ordered:
        row += n
        last_row[id(seq)] = row - 1
    seqs, drafts, first_rows, indices = [], [], [], []
    for s, n in scheduler_output.scheduled:
        d = tuple(spec.get(s.seq_id, ()))
        if s.num_computed_tokens + n != s.num_tokens + len(d) or s.pooling_params is not None:
            continue
        seqs.append(s)
        drafts.append(d)
        first_rows.append(len(indices))
        last = last_row[id(s)]
        indices.extend(range(last - len(d), last + 1))
    return LogitsLayout(tuple(seqs), tuple(drafts), tuple(first_rows), np.array(indices, dtype=np.int64))
