"""Runs a scheduled batch: the copy-on-write block copies, the step's inputs (``step_input``), the model on one
of its forward paths (``forward_paths``), the LM head and the sampling kernel. Owns the paged KV caches.
"""

from __future__ import annotations

import logging

import numpy as np

from rawpaged.core.kv_cache_groups import KVCacheGroupSpec, group_size, layer_slots
from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.dtypes import kv_row_bytes
from rawpaged.kernels.backend import split_block_mapping
from rawpaged.lora.page_store import PoolPages
from rawpaged.lora.punica import PunicaWrapper
from rawpaged.model_executor.cpu_fused_decode import CPUFusedDecode
from rawpaged.model_executor.cuda_graph import CUDAGraphRunner, cudagraph_capture_sizes
from rawpaged.model_executor.forward_paths import EagerForward
from rawpaged.model_executor.layers.pooler import pool_step
from rawpaged.model_executor.models.llama import LlamaModel
from rawpaged.model_executor.prompt_logprobs import prompt_logprobs
from rawpaged.model_executor.sampler import sampling_arrays
from rawpaged.model_executor.step_input import StepInput, build_step_input

logger = logging.getLogger(__name__)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one block of ``num_layers`` layers (a KV cache group's ``group_size``; every layer with one
    group), K and V (a quantized cache's scales included)."""
    return 2 * num_layers * block_size * num_kv_heads * kv_row_bytes(kv_cache_dtype, head_dim)


class ModelRunner:
    """Runs one engine step's forward pass.

    Args:
        model: the ``LlamaModel`` (weights already on ``model.backend``).
        num_blocks, block_size: KV pool geometry; the pool is ``group_size`` K and V tensors of
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``kv_cache_dtype``, and layer i's cache
            (``key_caches[i]``) is the tensor of its position in its KV cache group.
        kv_cache_groups: the pool's ``KVCacheGroupSpec``s; None: one group of every layer.
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
        lora_manager: the adapters' slots (``rawpaged.lora.models.LoRAModelManager``), or None without LoRA;
            its adapters' weights are kept in this pool's blocks (``attach_pages``).
            A step where some token has an adapter runs op by op (the static decode path and the fused CPU
            decode have no LoRA), the adapters added beside the linears (``rawpaged.lora.punica``).
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
        kv_cache_groups: tuple | None = None,
        lora_manager=None,
    ):
        self.kv_store = kv_store
        self.lora_manager = lora_manager
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        cfg = model.config
        groups = kv_cache_groups or (KVCacheGroupSpec(tuple(range(cfg.num_hidden_layers))),)
        slots = layer_slots(groups, cfg.num_hidden_layers)
        self.layer_groups = tuple(g for g, _ in slots) if len(groups) > 1 else ()
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        be = self.backend
        #: the pool's tensors, one K and one V per position in a group
        self.key_tensors = [be.allocate_kv_cache(shape, kv_cache_dtype) for _ in range(group_size(groups))]
        self.value_tensors = [be.allocate_kv_cache(shape, kv_cache_dtype) for _ in range(group_size(groups))]
        if lora_manager is not None:  # the adapters' weights live in the pool's blocks (rawpaged.lora.page_store)
            lora_manager.attach_pages(PoolPages(self.key_tensors + self.value_tensors))
        self.key_caches = [self.key_tensors[pos] for _, pos in slots]
        self.value_caches = [self.value_tensors[pos] for _, pos in slots]
        self.fused_decode = (
            CPUFusedDecode(model, self.key_caches, self.value_caches, layer_groups=self.layer_groups)
            if fused_decode and be.name == "cpu"
            else None
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
                self.layer_groups,
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
        self.kv_store.run(transfers, self.key_tensors, self.value_tensors)

    def execute_model(self, scheduler_output: SchedulerOutput):
        """Run the model for ``scheduler_output.scheduled`` = [(seq, num_new_tokens)].

        Runs the step's KV transfers and copies the copy-on-write blocks (``blocks_to_copy``) first, then
        makes the step's ``StepInput`` once and runs it on the first forward path that can
        (``forward_paths``: CUDA graph, CPU fused decode, op by op). Returns ``(logits, layout,
        prompt_logprobs)``: logits on the backend (see ``sample``, ``fetch_rows``) of the rows
        ``layout`` (``step_input.LogitsLayout``) lays out: for each sequence whose scheduled tokens reach
        its last token (it samples next), in ``scheduled`` order, one row, or k + 1 consecutive rows for a
        sequence verifying k drafts (``spec_token_ids``); and, for each sequence whose
        ``prompt_logprobs`` is set and whose prompt positions ran, ``{sequence: (index of the first
        prompt token scored, [its logprobs entry, ...])}`` (``prompt_logprobs.prompt_logprobs``); and
        ``{sequence: float32 vector}`` for each pooling sequence (``Sequence.pooling_params``) whose last
        prompt position ran (``layers.pooler.pool_step``; such a sequence has no logits row). So
        ``(logits, layout, prompt_logprobs, pooled)``.
        """
        self.run_kv_transfers(scheduler_output.kv_transfers)
        for group in split_block_mapping(scheduler_output.blocks_to_copy):
            self.backend.copy_blocks(self.key_tensors, self.value_tensors, group)
        step = build_step_input(scheduler_output)
        logits, hidden = self._forward_path(step, getattr(scheduler_output, "lora_pages", None)).forward_step(step)
        scored = {} if hidden is None else self._prompt_logprobs(hidden, step.ordered)
        pooled = pool_step(self.backend, hidden, step.ordered) if _pools(step) else {}
        return logits, step.layout, scored, pooled

    def _forward_path(self, step: StepInput, lora_pages: dict | None = None):
        """The first of the static decode path, the CPU's fused decode and the op-by-op forward that
        runs ``step``; a step with adapters (``lora_pages``: ``SchedulerOutput.lora_pages``), or with a pooling
        sequence (whose hidden states are pooled), runs op by op."""
        if step.lora_ids is None and _pools(step):
            return EagerForward(self.model, self.key_caches, self.value_caches, self.layer_groups)
        if step.lora_ids is not None:
            pages = lora_pages or None  # None: a scheduler without adapter pages (slots from host copies)
            lora = PunicaWrapper(self.lora_manager, self.lora_manager.token_slots(step.lora_ids, pages))
            return EagerForward(self.model, self.key_caches, self.value_caches, self.layer_groups, lora=lora)
        for path in (self.cuda_graph, self.fused_decode):
            if path is not None and path.can_run(step):
                return path
        return EagerForward(self.model, self.key_caches, self.value_caches, self.layer_groups)

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


def _pools(step: StepInput) -> bool:
    """Whether some sequence of ``step`` pools (embeddings)."""
    return any(s.pooling_params is not None for s, _ in step.ordered)
