"""The backend contract: everything the engine, the model runner and the model call on a backend.

``CPUBackend`` (NumPy + Numba, ``rawpaged.kernels.cpu.backend``) and ``CudaBackend`` (CuPy + ``cuda/*.cu``,
``rawpaged.kernels.cuda.backend``) both implement all of it, with the same names and semantics (vLLM's kernel
names), so nothing above this layer asks which backend it runs on. Arrays are the backend's own
(``xp``: NumPy or CuPy); shapes below use ``T`` tokens, ``H`` query heads, ``Hkv`` KV heads, ``D`` head_dim.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


def soft_cap_arg(logits_soft_cap) -> np.float32:
    """The attention kernels' ``logits_soft_cap`` argument: 0 for None or 0 (off), else the cap. Raises
    ValueError for a negative cap."""
    if logits_soft_cap is None:
        return np.float32(0.0)
    if float(logits_soft_cap) < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 or None, got {logits_soft_cap}")
    return np.float32(logits_soft_cap)


def sliding_window_arg(sliding_window) -> int:
    """The attention kernels' ``sliding_window`` argument: 0 for None (no window), else W. Raises
    ValueError for a window below 1."""
    if sliding_window is None:
        return 0
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return int(sliding_window)


def check_block_mapping(block_mapping, num_blocks: int) -> np.ndarray:
    """``block_mapping`` as int64 ``[n, 2]`` ``(src, dst)`` pairs, checked on the host before a copy:
    ids in ``[0, num_blocks)``, every dst distinct and none also a src of the same call (the kernels copy
    the pairs concurrently, so a chain or two writes to one block would race). A step's copy-on-write
    list can break the last two rules (a source freed and allocated again as another copy's target):
    :func:`split_block_mapping` cuts it into calls that keep them.

    Raises:
        ValueError: a pair breaking one of those rules (naming it).
    """
    m = np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if m.size and (m.min() < 0 or m.max() >= num_blocks):
        raise ValueError(f"block_mapping: block ids must be in [0, {num_blocks}), got {m.min()}..{m.max()}")
    dst = m[:, 1]
    if len(np.unique(dst)) != len(dst):
        raise ValueError(f"block_mapping: a destination block appears twice in {m.tolist()}")
    both = np.intersect1d(m[:, 0], dst)
    if both.size:
        raise ValueError(f"block_mapping: block {int(both[0])} is both a source and a destination")
    return m


def split_block_mapping(block_mapping) -> list:
    """``(src, dst)`` pairs, to be copied in their order, as consecutive int64 ``[k, 2]`` groups that
    ``copy_blocks`` may copy concurrently: a new group starts at a pair that reads a block the group
    writes, or writes a block the group reads or writes. Copying the groups one after another gives the
    in-order result."""
    groups, current, reads, writes = [], [], set(), set()
    for src, dst in np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2).tolist():
        if src in writes or dst in reads or dst in writes:
            groups.append(np.array(current, dtype=np.int64))
            current, reads, writes = [], set(), set()
        current.append((src, dst))
        reads.add(src)
        writes.add(dst)
    if current:
        groups.append(np.array(current, dtype=np.int64))
    return groups


@runtime_checkable
class Backend(Protocol):
    name: str
    """"cpu" or "cuda" (for messages and logs only)."""
    xp: object
    """The array module (``numpy`` or ``cupy``)."""
    dtype_pairs: tuple
    """(activation dtype, KV-cache dtype) name pairs this backend runs."""

    def auto_dtype(self, checkpoint_dtype: str | None) -> str:
        """The activation dtype ``dtype="auto"`` means here, given the checkpoint's ``torch_dtype``."""

    def default_kv_cache_memory(self, gpu_memory_utilization: float) -> int:
        """Bytes for the KV pool when the configuration gives no size (call after loading weights)."""

    # ---------------------------------------------------------------- arrays and weights
    def zeros(self, shape, dtype):
        """A zero-filled array of ``dtype`` (a NumPy dtype; ``ml_dtypes.bfloat16`` allowed)."""

    def asarray(self, x, dtype=None):
        """Host array -> backend array."""

    def to_numpy(self, x):
        """Backend array -> NumPy array (bfloat16 as ``ml_dtypes.bfloat16``)."""

    def load_weight(self, host, dtype: str):
        """A host tensor (e.g. memory-mapped safetensors) -> a backend array of ``dtype``."""

    def load_linear(self, parts: list, dtype: str):
        """HF ``[out_i, in]`` weights fused along ``out`` -> the weight layout ``linear`` takes."""

    def load_experts(self, parts: list, dtype: str):
        """Mixture-of-experts weights: stacks ``[E, N_i, K]`` (one ``[N_i, K]`` weight per expert, HF's
        ``[out, in]``; float arrays or GGUF ``QuantizedExperts``) fused along N -> the handle
        ``grouped_linear`` takes."""

    def finish_loading(self) -> None:
        """Wait for weight uploads and release what loading needed."""

    # ---------------------------------------------------------------- dense math
    def linear(self, x, weight, bias=None, float32_out: bool = False):
        """``x [n, in]`` times a weight from ``load_linear`` (+ bias) -> ``[n, out]`` in the activations'
        dtype, or in float32 with ``float32_out`` (the LM head: sampling and greedy ties see float32
        logits, not values rounded to bf16's 8 bits)."""

    def embedding(self, token_ids, table, scale=None):
        """Rows of ``table [vocab, hidden]`` for int64 ``token_ids [T]``; with ``scale`` (a float), times
        the scale rounded to the rows' dtype, each product rounded to it (HF Gemma's embedding
        normalizer)."""

    def rms_norm(self, x, weight, eps: float, residual=None):
        """RMSNorm of ``x [T, hidden]`` (Zhang & Sennrich 2019); with ``residual``, ``residual += x``
        first and the norm of the sum is returned."""

    def rotary_embedding(self, positions, query, key, cos_sin_cache) -> None:
        """RoPE in place on ``query [T, H, D]`` and ``key [T, Hkv, D]`` (rotate-half layout)."""

    def silu_and_mul(self, x):
        """``silu(x[:, :d]) * x[:, d:]`` for ``x [T, 2d]`` (SwiGLU)."""

    def gelu_tanh_and_mul(self, x):
        """``gelu_tanh(x[:, :d]) * x[:, d:]`` for ``x [T, 2d]`` (GeGLU, PyTorch's tanh approximation)."""

    # ---------------------------------------------------------------- mixture of experts
    def moe_route(self, router_logits, top_k: int, softmax_before_topk: bool, renormalize: bool) -> tuple:
        """Router top-k of float32 logits ``[T, E]`` -> ``(topk_ids int32 [T, k], topk_weights float32 [T,
        k])``: the k largest (ties: the lower expert index), weighted by the softmax over all E
        (``softmax_before_topk``; divided by their sum when ``renormalize``) or by the softmax over the k
        selected logits. ValueError for k outside ``[1, E]``."""

    def moe_align(self, topk_ids, num_experts: int) -> tuple:
        """``(sorted_ids int32 [T * k], expert_offsets int64 [E + 1])``: the flat (token, slot) indices
        ``t * k + j`` of ``topk_ids [T, k]`` sorted by expert (stable); expert e's rows are
        ``expert_offsets[e] : expert_offsets[e + 1]``."""

    def grouped_linear(self, x, expert_offsets, experts):
        """``x [M, K]`` (rows in expert order, ``expert_offsets`` int64 ``[E + 1]``) -> ``[M, N]``: row r of
        expert e times expert e's weight transposed (``x[r] @ W_e.T``), ``experts`` from ``load_experts``.
        An expert with no rows is never read."""

    def moe_combine(self, y, sorted_ids, topk_weights, num_tokens: int, shared=None, shared_gate=None):
        """``[num_tokens, H]`` in y's dtype: each token's k rows of ``y [T * k, H]`` (in ``sorted_ids``
        order), weighted by ``topk_weights [T, k]`` and summed in slot order; with ``shared [T, H]`` (a
        shared expert's output, y's dtype), plus ``shared[t] * sigmoid(shared_gate[t])`` (float32 ``[T,
        1]``) in the same pass."""

    # ---------------------------------------------------------------- paged KV cache
    def allocate_kv_cache(self, shape, kv_cache_dtype: str):
        """One layer's K (or V) cache ``[num_blocks, block_size, Hkv, D]`` of ``kv_cache_dtype``, zeroed: an
        array, or for int8/fp8_e4m3 a ``kv_cache.QuantizedKVCache`` (values and per-row scales)."""

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """Scatter ``key``/``value [T, Hkv, D]`` into their slots of the ``[num_blocks, block_size, Hkv,
        D]`` caches (``slot_mapping`` int64 ``[T]``)."""

    def paged_attention(
        self,
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len=None,
        sliding_window=None,
        logits_soft_cap=None,
    ) -> None:
        """Decode attention: one query token per sequence over its cached K/V, read through its block
        table (with ``sliding_window`` W: over its last W positions only; with ``logits_soft_cap`` c > 0,
        each scaled score s becomes ``c * tanh(s / c)`` before the softmax)."""

    def prefill_attention(
        self,
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len=None,
        sliding_window=None,
        logits_soft_cap=None,
    ) -> None:
        """Causal attention of each sequence's new tokens over all its cached K/V (plain, chunked and
        prefix-cached prefill); with ``sliding_window`` W, token p sees positions p - W + 1 .. p; with
        ``logits_soft_cap`` c > 0, each scaled score s becomes ``c * tanh(s / c)`` before the softmax."""

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        """Copy-on-write: ``(src, dst)`` block copies (int64 ``[n, 2]``) for every layer in one call."""

    # ---------------------------------------------------------------- sampling
    def sample(self, logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
        """One token id per sample (int64 host array): greedy where temperature is 0, else temperature,
        top-k, top-p and min-p filtering, and an inverse-CDF draw with the sample's uniform."""

    def apply_token_bitmask(self, logits, bitmask, rows) -> None:
        """Structured outputs: set to ``-inf``, in place, the logits of ``rows[i]`` whose token bit is clear
        in row ``i`` of the packed int32 ``bitmask`` (host arrays; bit ``t % 32`` of word ``t // 32``)."""

    def apply_logits_edits(self, logits, edits) -> None:
        """Sampling parameters' sparse edits of logits rows, in place (``LogitsEdits``, host arrays):
        additive entries, then repetition-penalty entries, then frequency/presence entries."""

    def logprob_rows(self, logits, targets, k: int) -> tuple:
        """Log-softmax reductions of a chunk of logits rows ``[m, vocab]`` (prompt logprobs; the rows may be
        overwritten) for host int ``targets [m]``: host arrays ``(target_logprobs float64 [m], target_ranks
        int64 [m], top_ids int64 [m, k], top_logprobs float64 [m, k])`` (``rawpaged.kernels.cpu.logprobs``)."""
