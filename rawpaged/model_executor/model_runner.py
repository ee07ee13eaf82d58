"""Turns a scheduled batch into arrays (input ids, positions, ``slot_mapping``, block tables), runs the
copy-on-write block copies, the model, the LM head and the sampling kernel. Owns the paged KV caches.
"""

from __future__ import annotations

import logging

import numpy as np

from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.dtypes import kv_row_bytes
from rawpaged.kernels.backend import split_block_mapping
from rawpaged.model_executor.cpu_fused_decode import CPUFusedDecode
from rawpaged.model_executor.cuda_graph import CUDAGraphRunner, cudagraph_capture_sizes
from rawpaged.model_executor.models.llama import AttentionMetadata, LlamaModel
from rawpaged.model_executor.prompt_logprobs import prompt_logprobs
from rawpaged.model_executor.sampler import sampling_arrays

logger = logging.getLogger(__name__)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one block across all layers, K and V (a quantized cache's scales included)."""
    return 2 * num_layers * block_size * num_kv_heads * kv_row_bytes(kv_cache_dtype, head_dim)


class ModelRunner:
    """Runs one engine step's forward pass.

    Args:
        model: the ``LlamaModel`` (weights already on ``model.backend``).
        num_blocks, block_size: KV pool geometry; caches per layer are
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``kv_cache_dtype``.
        enforce_eager: run every step kernel by kernel. Otherwise pure-decode steps of up to
            ``max_num_seqs`` sequences run on static input buffers (``cuda_graph``), replayed as CUDA
            graphs captured here on a backend that has them (``backend.supports_cuda_graphs``).
        max_num_seqs, max_model_len: size the static decode buffers (needed unless ``enforce_eager``).
        fused_decode: on the CPU backend, run the layers of pure-decode steps (up to
            ``kernels.cpu.gemm.SMALL_M`` rows) in one compiled call (``cpu_fused_decode``; the same kernels and
            results as op by op, without the per-op dispatch). Ignored on other backends; the static
            decode path, when enabled, takes the steps it covers first.
        kv_store: the second KV tier's bytes (``kv_offload_store.HostKVStore``, its layout these caches'), or
            None without a tier.
    """

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype="float32",
        *,
        enforce_eager: bool = True,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        fused_decode: bool = True,
        kv_store=None,
    ):
        self.kv_store = kv_store
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        be = self.backend
        self.key_caches = [be.allocate_kv_cache(shape, kv_cache_dtype) for _ in range(cfg.num_hidden_layers)]
        self.value_caches = [be.allocate_kv_cache(shape, kv_cache_dtype) for _ in range(cfg.num_hidden_layers)]
        self.fused_decode = (
            CPUFusedDecode(model, self.key_caches, self.value_caches) if fused_decode and be.name == "cpu" else None
        )
        self.cuda_graph = None
        if not enforce_eager:
            if max_num_seqs is None or max_model_len is None:
                raise ValueError("the static decode path needs max_num_seqs and max_model_len")
            self.cuda_graph = CUDAGraphRunner(
                model,
                self.key_caches,
                self.value_caches,
                cudagraph_capture_sizes(max_num_seqs),
                max_model_len,
                block_size,
            )
            if be.supports_cuda_graphs:
                self.cuda_graph.capture_all()
            else:
                logger.info(
                    "the %s backend has no CUDA graphs: decode steps run on static buffers, kernel by kernel",
                    be.name,
                )

    def run_kv_transfers(self, transfers) -> None:
        """A step's copies between the pool and the second KV tier (``KVTransfers``): stores, then loads.
        Called first by ``execute_model``; the engine calls it alone for a step that runs no model."""
        if self.kv_store is None or not transfers:
            return
        self.kv_store.run(transfers, self.key_caches, self.value_caches)

    def execute_model(self, scheduler_output: SchedulerOutput):
        """Run the model for ``scheduler_output.scheduled`` = [(seq, num_new_tokens)].

        Copies the copy-on-write blocks (``blocks_to_copy``) first. Returns ``(logits, sampling_seqs,
        prompt_logprobs)``: logits on the backend (see ``sample``, ``fetch_rows``) for the sequences whose
        scheduled tokens reach their last token (they sample next), in ``scheduled`` order: one row each,
        except that a sequence verifying drafts (``spec_token_ids``: it computes its last token and its k
        drafts, as k + 1 decode rows) has k + 1 consecutive rows, one per position; and, for each sequence
        whose ``prompt_logprobs`` is set and whose prompt positions ran, ``{sequence: (index of the first
        prompt token scored, [its logprobs entry, ...])}`` (``prompt_logprobs.prompt_logprobs``).
        """
        be = self.backend
        scheduled = scheduler_output.scheduled
        spec = scheduler_output.spec_token_ids
        self.run_kv_transfers(scheduler_output.kv_transfers)
        for group in split_block_mapping(scheduler_output.blocks_to_copy):
            be.copy_blocks(self.key_caches, self.value_caches, group)
        decodes, prefills = [], []
        for s, n in scheduled:  # a decode computes exactly the last token, and any drafts after it
            decoding = s.num_computed_tokens == s.num_tokens - 1 and n == 1 + len(spec.get(s.seq_id, ()))
            (decodes if decoding else prefills).append((s, n))
        graph = self.cuda_graph
        if graph is not None and not prefills and not spec and 0 < len(decodes) <= graph.max_batch_size:
            seqs = [s for s, _ in decodes]  # every decode samples, in scheduled order
            return graph.run(seqs), seqs, {}
        ordered = decodes + prefills
        ids, positions, slots = [], [], []
        for seq, n in ordered:
            start = seq.num_computed_tokens
            positions.extend(range(start, start + n))
            drafts = spec.get(seq.seq_id, ())
            ids.extend(seq.token_at(p) for p in range(start, start + n - len(drafts)))
            ids.extend(drafts)
            slots.extend(seq.block_table.slots(start, start + n))

        def tables(group, rows_each):
            width = max((len(s.block_table.block_ids) for s, _ in group), default=0)
            bt = np.zeros((sum(rows_each(n) for _, n in group), max(width, 1)), dtype=np.int32)
            row = 0
            for s, n in group:
                rows = rows_each(n)
                bt[row : row + rows, : len(s.block_table.block_ids)] = s.block_table.block_ids
                row += rows
            return bt

        # A decode row per new token: a sequence verifying k drafts is k + 1 decode rows over its one block
        # table, row i attending its context plus the first i new tokens (causal, as its prefill would),
        # since each layer writes every row's K and V before any row attends.
        decode_lens = [s.num_computed_tokens + i + 1 for s, n in decodes for i in range(n)]
        qsl = np.zeros(len(prefills) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum([n for _, n in prefills])
        attn = AttentionMetadata(
            slot_mapping=be.asarray(np.array(slots, dtype=np.int64)),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=be.asarray(tables(decodes, lambda n: n)),
            decode_context_lens=be.asarray(np.array(decode_lens, dtype=np.int32)),
            prefill_block_tables=be.asarray(tables(prefills, lambda n: 1)),
            query_start_loc=be.asarray(qsl),
            prefill_seq_lens=be.asarray(np.array([s.num_computed_tokens + n for s, n in prefills], dtype=np.int32)),
            max_query_len=max((n for _, n in prefills), default=0),
            max_context_len=max(decode_lens, default=0),
        )
        input_ids = be.asarray(np.array(ids, dtype=np.int64))
        input_positions = be.asarray(np.array(positions, dtype=np.int64))
        fused = self.fused_decode
        if fused is not None and not prefills and fused.can_run(len(decode_lens)):
            hidden = fused.forward(input_ids, input_positions, attn)
        else:
            hidden = self.model.forward(input_ids, input_positions, attn, self.key_caches, self.value_caches)
        # Row of each sequence's last new token; only sequences that reach their end sample (with drafts:
        # their last k + 1 rows).
        last_row, row = {}, 0
        for seq, n in ordered:
            row += n
            last_row[id(seq)] = row - 1
        scored = self._prompt_logprobs(hidden, ordered)
        sampling = [s for s, n in scheduled if s.num_computed_tokens + n == s.num_tokens + len(spec.get(s.seq_id, ()))]
        if not sampling:
            return np.zeros((0, self.model.config.vocab_size), np.float32), [], scored
        rows = []
        for s in sampling:
            last = last_row[id(s)]
            rows.extend(range(last - len(spec.get(s.seq_id, ())), last + 1))
        return self.model.compute_logits(hidden[be.asarray(np.array(rows, dtype=np.int64))]), sampling, scored

    def _prompt_logprobs(self, hidden, ordered: list) -> dict:
        """Prompt logprobs of this step's prompt positions, for the sequences that ask (see
        ``execute_model``): the hidden state at position ``p`` scores prompt token ``p + 1``. Tokens a
        sequence already has (recomputed after preemption) are not scored again."""
        scored, row = {}, 0
        for seq, n in ordered:
            k = seq.sampling_params.prompt_logprobs
            start = seq.num_computed_tokens
            if k is not None:
                first = max(start + 1, len(seq.prompt_logprobs), 1)  # prompt token indices first..last
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first <= last:
                    rows = hidden[row + first - 1 - start : row + last - start]
                    targets = seq.prompt_token_ids[first : last + 1]
                    entries = prompt_logprobs(self.model.compute_logits, self.backend.logprob_rows, rows, targets, k)
                    scored[seq] = (first, entries)
            row += n
        return scored

    def sample(self, logits, draws: list):
        """Token ids for ``draws`` = [(logits row, SamplingParams, uniform)], drawn on the backend (only
        the ids reach the host). Returns int64 ``[len(draws)]``."""
        return self.backend.sample(logits, **sampling_arrays(draws, self.model.config.vocab_size))

    def apply_token_bitmask(self, logits, bitmask, rows: list) -> None:
        """Forbid, in each logits row of ``rows``, the tokens its int32 ``bitmask`` row leaves unset
        (``bitmask [len(rows), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32``), on the backend."""
        self.backend.apply_token_bitmask(logits, bitmask, np.array(rows, dtype=np.int64))

    def apply_logits_edits(self, logits, edits) -> None:
        """Apply a step's ``logits_processors.LogitsEdits`` (penalties, logit bias, banned tokens) to the
        logits rows, in place, on the backend."""
        self.backend.apply_logits_edits(logits, edits)

    def fetch_rows(self, logits, rows: list) -> dict:
        """float32 host copies of the logits ``rows`` that need the whole distribution (logprobs, beam
        search, best_of): ``{row: float32 [vocab]}``."""
        if not rows:
            return {}
        be = self.backend
        host = be.to_numpy(logits[be.asarray(np.array(rows, dtype=np.int64))]).astype(np.float32, copy=False)
        return dict(zip(rows, host))
