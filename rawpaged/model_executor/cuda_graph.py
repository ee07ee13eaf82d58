"""Decode steps on static input buffers, replayed as CUDA graphs per batch-size bucket.

A CUDA graph records a sequence of kernel launches with their arguments (device addresses, sizes) and
relaunches all of them with one call, where an eager decode step of the default model costs about 300
launches, each with its Python and driver overhead. Arguments are frozen at capture, so a replayed step
must find its inputs where the capture read them: a decode step's token ids, positions,
``slot_mapping``, context lengths and block tables are written into one packed host buffer and copied,
in one upload, into a device buffer of the same layout whose views the captured forward reads
(:class:`DecodeInputBuffers`). Launch sizes are frozen too: a batch runs in the graph of the smallest
captured size that holds it (:func:`padded_batch_size`), and the rows past the batch are padding, with
context length 0 (attends to nothing, writes zeros) and slot -1 (writes no K/V); their logits are
dropped. Decode attention is sized for ``max_model_len`` rather than the step's longest context.

Prefill and mixed steps, and batches above the largest size, stay eager. Backends without graphs (the
CPU, the CUDA emulation) run the same static-buffer step kernel by kernel, so the bucket choice, the
padding and the buffer reuse are tested without a GPU.

After vLLM's ``CUDAGraphRunner`` (``vllm/worker/model_runner.py``, v0) and ``cudagraph_capture_sizes``
(``vllm/config``): capture per batch size into static buffers, pad to the next size, replay.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np

from rawpaged.model_executor.models.llama import AttentionMetadata

logger = logging.getLogger(__name__)


def cudagraph_capture_sizes(max_num_seqs: int) -> list:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (included,
    whatever it is). Raises ValueError for ``max_num_seqs`` < 1."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``num_seqs``, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeInputBuffers:
    """The inputs of a decode step at fixed addresses: one packed host buffer and one device buffer of
    the same layout, filled per step and copied with one upload.

    Layout: int64 ``input_ids``, ``positions``, ``slot_mapping`` (``[max_batch_size]`` each), then int32
    ``context_lens [max_batch_size]`` and ``block_tables [max_batch_size, max_blocks_per_seq]``, last, so
    that a step of ``bucket`` rows needs only the buffer's first :meth:`used_bytes` (the block tables are
    most of it: 256 rows x 512 blocks are 512 KiB). The device attributes of the same names are views of
    the device buffer; ``[:bucket]`` slices of them are a step's inputs. Initially every row is padding.

    Args:
        backend: provides ``zeros`` and ``upload``.
        max_batch_size: rows (the largest captured size).
        max_blocks_per_seq: block-table width, ``ceil(max_model_len / block_size)``.
    """

    def __init__(self, backend, max_batch_size: int, max_blocks_per_seq: int):
        if max_batch_size < 1 or max_blocks_per_seq < 1:
            raise ValueError(
                f"need max_batch_size and max_blocks_per_seq >= 1, got {max_batch_size}, {max_blocks_per_seq}"
            )
        self.backend = backend
        self.max_batch_size = B = max_batch_size
        self.max_blocks_per_seq = W = max_blocks_per_seq
        i64_bytes = 3 * B * 8
        self._tables_offset = i64_bytes + B * 4
        self.nbytes = self._tables_offset + B * W * 4
        self.host = np.zeros(self.nbytes, np.uint8)
        self.device = backend.zeros((self.nbytes,), np.uint8)
        self.host_views = self._views(self.host, i64_bytes)
        views = self._views(self.device, i64_bytes)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables = views
        self._row_width = np.zeros(B, np.int64)  # block-table entries written per row (the rest are 0)
        self.host_views[2][:] = -1
        self.upload()

    def _views(self, buf, i64_bytes):
        B, W = self.max_batch_size, self.max_blocks_per_seq
        i64 = buf[:i64_bytes].view(np.int64)
        i32 = buf[i64_bytes:].view(np.int32)
        return i64[:B], i64[B : 2 * B], i64[2 * B :], i32[:B], i32[B:].reshape(B, W)

    def fill(self, seqs: list, bucket: int, group: int = 0) -> None:
        """Write the decode inputs of ``seqs`` (each computes its last token), with their block tables of KV
        cache group ``group``, into rows ``0 .. len-1`` of the host buffer and padding into rows
        ``len .. bucket-1`` (see :meth:`write`)."""
        pos = [seq.num_computed_tokens for seq in seqs]
        self.write(
            bucket,
            [seq.token_at(p) for seq, p in zip(seqs, pos)],
            pos,
            [seq.block_tables[group].slots(p, p + 1)[0] for seq, p in zip(seqs, pos)],
            [seq.num_tokens for seq in seqs],
            [seq.block_tables[group].block_ids for seq in seqs],
        )

    def write(self, bucket: int, input_ids, positions, slot_mapping, context_lens, block_ids: list) -> None:
        """Write one decode row per entry (int sequences of equal length; ``block_ids``: each row's
        block table) into rows ``0 .. len-1`` of the host buffer and padding into rows ``len .. bucket-1``:
        token 0 at position 0, slot -1, context length 0, an all-zero block table. Raises ValueError when
        the batch exceeds ``bucket`` or a block table the width."""
        n = len(block_ids)
        if not n <= bucket <= self.max_batch_size:
            raise ValueError(f"{n} sequences do not fit a bucket of {bucket} (max {self.max_batch_size})")
        ids, positions_, slots, ctx, tables = self.host_views
        positions_[:n] = positions
        ids[:n] = input_ids
        slots[:n] = slot_mapping
        ctx[:n] = context_lens
        for row, row_blocks in enumerate(block_ids):
            width = len(row_blocks)
            if width > self.max_blocks_per_seq:
                raise ValueError(f"a block table of {width} blocks exceeds the width {self.max_blocks_per_seq}")
            tables[row, :width] = row_blocks
            if self._row_width[row] > width:
                tables[row, width : self._row_width[row]] = 0
            self._row_width[row] = width
        ids[n:bucket] = 0
        positions_[n:bucket] = 0
        slots[n:bucket] = -1
        ctx[n:bucket] = 0
        for row in range(n, bucket):
            if self._row_width[row]:
                tables[row, : self._row_width[row]] = 0
                self._row_width[row] = 0

    def used_bytes(self, bucket: int) -> int:
        """Bytes at the start of the buffer that hold everything rows ``0 .. bucket-1`` read."""
        return self._tables_offset + bucket * self.max_blocks_per_seq * 4

    def upload(self, bucket: int | None = None) -> None:
        """Copy the host buffer's first :meth:`used_bytes` (all of it without ``bucket``) to the device
        buffer: one copy, on the current stream."""
        n = self.nbytes if bucket is None else self.used_bytes(bucket)
        self.backend.upload(self.device[:n], self.host[:n])


class CUDAGraphRunner:
    """Runs pure-decode steps of up to ``max(capture_sizes)`` sequences on :class:`DecodeInputBuffers`,
    replaying one captured graph per size on backends that capture (``backend.supports_cuda_graphs``).

    Args:
        model: the ``LlamaModel``.
        key_caches, value_caches: the runner's per-layer KV caches (fixed for the graphs' lifetime).
        capture_sizes: ascending batch sizes (:func:`cudagraph_capture_sizes`).
        max_model_len: sizes decode attention's launch (and the block-table width with ``block_size``).
        block_size: tokens per KV block.
        layer_groups: each layer's KV cache group index (empty: one group); each group has its own buffers
            (its ``slot_mapping`` and block tables; the first group's hold the step's other inputs).
    """

    def __init__(
        self,
        model,
        key_caches,
        value_caches,
        capture_sizes: list,
        max_model_len: int,
        block_size: int,
        layer_groups: tuple = (),
    ):
        if not capture_sizes or list(capture_sizes) != sorted(set(capture_sizes)) or capture_sizes[0] < 1:
            raise ValueError(f"capture_sizes must be ascending positive sizes, got {capture_sizes}")
        self.model = model
        self.backend = model.backend
        self.key_caches, self.value_caches = key_caches, value_caches
        self.capture_sizes = list(capture_sizes)
        self.max_model_len = max_model_len
        self.layer_groups = tuple(layer_groups)
        width = -(-max_model_len // block_size)
        num_groups = max(self.layer_groups, default=0) + 1
        self.group_buffers = [
            DecodeInputBuffers(self.backend, self.capture_sizes[-1], width) for _ in range(num_groups)
        ]
        self.buffers = self.group_buffers[0]
        be = self.backend
        self._no_prefill_tables = be.asarray(np.zeros((0, 1), np.int32))
        self._no_prefill_lens = be.asarray(np.zeros(0, np.int32))
        self._query_start_loc = be.asarray(np.zeros(1, np.int32))
        self.graphs: dict = {}  # bucket -> (replay, logits)
        self.num_steps = {s: 0 for s in self.capture_sizes}

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def forward(self, bucket: int, max_context_len: int | None = None):
        """The decode forward of the first ``bucket`` rows of the device buffers: float32 logits
        ``[bucket, vocab]``. What a graph captures, with decode attention sized for ``max_model_len``
        (a step run without a graph passes its own longest context instead)."""
        b = self.buffers
        groups = tuple(
            AttentionMetadata(
                slot_mapping=g.slot_mapping[:bucket],
                num_decode_tokens=bucket,
                decode_block_tables=g.block_tables[:bucket],
                decode_context_lens=b.context_lens[:bucket],
                prefill_block_tables=self._no_prefill_tables,
                query_start_loc=self._query_start_loc,
                prefill_seq_lens=self._no_prefill_lens,
                max_query_len=0,
                max_context_len=self.max_model_len if max_context_len is None else max_context_len,
            )
            for g in self.group_buffers
        )
        attn = groups[0]
        if len(groups) > 1:
            attn.groups, attn.layer_groups = groups, self.layer_groups
        hidden = self.model.forward(
            b.input_ids[:bucket], b.positions[:bucket], attn, self.key_caches, self.value_caches
        )
        return self.model.compute_logits(hidden)

    def capture_all(self) -> float:
        """Capture a graph per size, largest first (later captures reuse its buffers), with every row
        padding (nothing is written to the KV caches). Returns the seconds it took. Raises
        RuntimeError on a backend without graphs."""
        t0 = time.perf_counter()
        for size in reversed(self.capture_sizes):
            self.graphs[size] = self.backend.capture_graph(lambda size=size: self.forward(size))
        seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.capture_sizes, seconds)
        return seconds

    def run(self, seqs: list):
        """Logits ``[len(seqs), vocab]`` (float32, on the backend) of one decode step of ``seqs``, each
        computing its last token, in their order. With graphs the array is the graph's output buffer:
        read it before the next step. Raises ValueError above the largest size."""
        bucket = self._bucket(len(seqs))
        for g, buffers in enumerate(self.group_buffers):
            buffers.fill(seqs, bucket, g)
        return self._replay(bucket, len(seqs), max(seq.num_tokens for seq in seqs))

    def can_run(self, step) -> bool:
        """Whether ``step`` (a ``StepInput``) runs here: pure decode, no drafts, 1 to ``max_batch_size`` rows,
        the KV cache groups these buffers were made for."""
        return (
            step.num_groups == len(self.group_buffers)
            and not step.prefills
            and not step.has_drafts
            and 0 < len(step.decodes) <= self.max_batch_size
        )

    def forward_step(self, step) -> tuple:
        """``(logits, None)`` of a ``StepInput`` that :meth:`can_run` (as :meth:`run` of its decodes; the
        step's host arrays fill the buffers). No hidden states: no row of such a step scores its prompt."""
        n = len(step.decodes)
        bucket = self._bucket(n)
        lens = step.decode_context_lens
        slots = step.group_slot_mappings or (step.slot_mapping,)
        for g, buffers in enumerate(self.group_buffers):
            tables = [s.block_tables[g].block_ids for s, _ in step.decodes]
            buffers.write(bucket, step.input_ids, step.positions, slots[g], lens, tables)
        return self._replay(bucket, n, int(lens.max())), None

    def _bucket(self, num_seqs: int) -> int:
        bucket = padded_batch_size(num_seqs, self.capture_sizes)
        if bucket is None or not num_seqs:
            raise ValueError(f"{num_seqs} sequences: the static decode path takes 1 to {self.max_batch_size}")
        return bucket

    def _replay(self, bucket: int, n: int, max_context_len: int):
        """Upload the filled buffers and run the step: the graph of ``bucket`` if captured, else kernel by
        kernel. Logits of the first ``n`` rows."""
        for buffers in self.group_buffers:
            buffers.upload(bucket)
        self.num_steps[bucket] += 1
        graph = self.graphs.get(bucket)
        if graph is None:
            return self.forward(bucket, max_context_len)[:n]
        replay, logits = graph
        replay()
        return logits[:n]
