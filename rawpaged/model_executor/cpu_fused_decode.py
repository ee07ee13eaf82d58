"""Pure-decode steps on the CPU backend as one compiled call: the decoder layers of ``models.llama`` in
one Numba function, the CPU's counterpart of replaying a CUDA graph (``cuda_graph``).

Kernel by kernel, a decode step of the default model makes about 330 calls from Python into Numba (11
per layer: norms, products, RoPE, cache write, attention, SwiGLU), each paying argument checks, an
output allocation and Numba's dispatch (type checks and unboxing of every array): 5-10 us a call, a
few milliseconds of a 20 ms batch-1 step. Here the embedding lookup and the LM head stay in Python and
everything between them is one call.

The compiled step calls the same kernels the backend's ops call (``cpu_gemm._gemv_nt``/``_gemm_nt``,
``cpu_quant``'s GEMVs and row products, ``cpu._rms_norm_rows``, ``_rotate_half``, the cache writes,
``_paged_attention_*``, ``_silu_and_mul_rows``) on the same inputs, in ``LlamaModel.forward``'s order,
so its hidden states equal the op-by-op forward's bit for bit (tests/model_executor/test_cpu_fused_decode.py
holds it to that). Each kernel with a parallel loop still forks and joins the thread pool as it does when
called from Python.

One choice differs: attention always takes the thread-parallel kernel (whose tasks compute exactly what
the serial one does). Op by op, attention below ``cpu.PARALLEL_MIN_WORK`` runs serially because the
products before it may be OpenBLAS's, whose spinning threads make waking Numba's pool cost more than
the work; here every product is a Numba kernel, so the pool's threads are already awake.

Weights and caches are handed over once, as ``numba.typed.List``s of the arrays the model already holds
(no copy): a float32 linear weight as its ``[out, in]`` array, a quantized one as the tuple ``(format,
qs, scales, mins)`` of its repacked planes (``cpu_quant.RepackedQuantized``). A model whose layers mix
weight formats within one projection, or mix quantized and float32, still runs; Numba compiles the step
for each combination of list types it meets.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import typed
from numba import types as nb_types
from numba.extending import overload

from rawpaged.kernels import cpu, cpu_gemm, cpu_quant
from rawpaged.kernels.backend import sliding_window_arg

_JIT = dict(cache=True, nogil=True)


def _linear(x, w, out, max_chunks):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(_linear, jit_options=_JIT)
def _linear_impl(x, w, out, max_chunks):
    """``out [Mp, N] = x [Mp, K] @ W.T`` for a float32 ``W [N, K]`` or a quantized weight given as
    ``(format, qs, scales, mins)``; rows as ``CPUBackend.linear`` takes them (GEMV for one row, else
    x padded to a multiple of ``cpu_gemm.TILE_M`` rows; ``max_chunks`` as ``cpu_quant.quant_linear`` sizes
    them: Numba's thread count read inside compiled code would keep it from being cached)."""
    if isinstance(w, nb_types.Array):

        def dense(x, w, out, max_chunks):
            if x.shape[0] == 1:
                cpu_gemm._gemv_nt(x[0], w, out[0])
            else:
                cpu_gemm._gemm_nt(x, w, out)

        return dense

    def quantized(x, w, out, max_chunks):
        fmt, qs, scales, mins = w
        if x.shape[0] == 1:
            if fmt == 0:
                cpu_quant._gemv_q8_0(x[0], qs, scales, out[0])
            else:
                cpu_quant._gemv_q4(x[0], qs, scales, mins, fmt == 2, out[0])
            return
        passes = -(-qs.shape[0] * cpu_quant.R // cpu_quant.ROWS_PER_PASS)
        res = np.empty((x.shape[0], passes * cpu_quant.ROWS_PER_PASS), np.float32)
        cpu_quant._gemm_rows(fmt, x, qs, scales, mins, res, max_chunks)
        n = out.shape[1]
        for r in range(x.shape[0]):
            out[r, :] = res[r, :n]

    return quantized


def _write_kv(key, value, key_cache, value_cache, slot_mapping):  # pragma: no cover - see the overload
    raise NotImplementedError


@overload(_write_kv, jit_options=_JIT)
def _write_kv_impl(key, value, key_cache, value_cache, slot_mapping):
    """``cpu.reshape_and_cache`` for float32 caches or bf16 caches seen as their uint16 bits."""
    if key_cache.dtype == nb_types.uint16:

        def bf16(key, value, key_cache, value_cache, slot_mapping):
            key_bits, value_bits = key.view(np.uint32), value.view(np.uint32)
            cpu._reshape_and_cache_bf16(key_bits, value_bits, key_cache, value_cache, slot_mapping)

        return bf16

    def f32(key, value, key_cache, value_cache, slot_mapping):
        cpu._reshape_and_cache_f32(key, value, key_cache, value_cache, slot_mapping)

    return f32


@nb.njit(**_JIT)
def _decode_layers(
    residual,
    positions,
    slot_mapping,
    block_tables,
    context_lens,
    key_caches,
    value_caches,
    input_norms,
    post_norms,
    qkv_proj,
    qkv_bias,
    q_norms,
    k_norms,
    o_proj,
    gate_up_proj,
    down_proj,
    final_norm,
    cos_sin_cache,
    eps,
    scale,
    window,
    num_heads,
    intermediate_size,
    attention_nkv,
    parallel_attention,
    max_chunks,
    out,
):
    """``LlamaModel.forward`` for decode rows only (module docstring); ``residual`` (the embeddings,
    float32 ``[M, hidden]``) is updated in place and ``out [M, hidden]`` gets the final norm."""
    M, H = residual.shape
    Mp = 1 if M == 1 else -(-M // cpu_gemm.TILE_M) * cpu_gemm.TILE_M
    num_kv_heads, head_dim = key_caches[0].shape[2], key_caches[0].shape[3]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    has_bias = len(qkv_bias) == len(qkv_proj)
    has_qk_norm = len(q_norms) == len(qkv_proj)
    x = np.zeros((Mp, H), np.float32)  # padding rows stay zero through every product
    h = np.zeros((Mp, H), np.float32)
    qkv = np.zeros((Mp, q_dim + 2 * kv_dim), np.float32)
    q = np.empty((M, num_heads, head_dim), np.float32)
    k = np.empty((M, num_kv_heads, head_dim), np.float32)
    v = np.empty((M, num_kv_heads, head_dim), np.float32)
    att = np.empty((M, num_heads, head_dim), np.float32)
    att_rows = np.zeros((Mp, q_dim), np.float32)
    gate_up = np.zeros((Mp, 2 * intermediate_size), np.float32)
    act = np.zeros((Mp, intermediate_size), np.float32)
    q_rows, q_flat = q.reshape((M * num_heads, head_dim)), q.reshape(M * q_dim)
    k_rows, k_flat, v_flat = k.reshape((M * num_kv_heads, head_dim)), k.reshape(M * kv_dim), v.reshape(M * kv_dim)
    att_flat = att.reshape(M * q_dim)
    for i in range(len(qkv_proj)):
        if i == 0:
            cpu._rms_norm_rows(residual, input_norms[i], eps, x)
        else:
            cpu._add_rms_norm_rows(h[:M], residual, input_norms[i], eps, x)
        _linear(x, qkv_proj[i], qkv, max_chunks)
        for r in range(M):
            if has_bias:
                row = qkv[r]
                bias = qkv_bias[i]
                for c in range(row.shape[0]):
                    row[c] += bias[c]
            for c in range(q_dim):
                q_flat[r * q_dim + c] = qkv[r, c]
            for c in range(kv_dim):
                k_flat[r * kv_dim + c] = qkv[r, q_dim + c]
                v_flat[r * kv_dim + c] = qkv[r, q_dim + kv_dim + c]
        if has_qk_norm:
            cpu._rms_norm_rows(q_rows, q_norms[i], eps, q_rows)
            cpu._rms_norm_rows(k_rows, k_norms[i], eps, k_rows)
        cpu._rotate_half(positions, q, cos_sin_cache)
        cpu._rotate_half(positions, k, cos_sin_cache)
        _write_kv(k, v, key_caches[i], value_caches[i], slot_mapping)
        if parallel_attention:
            cpu._paged_attention_parallel(
                att, q, key_caches[i], value_caches[i], block_tables, context_lens, scale, attention_nkv, window
            )
        else:
            cpu._paged_attention_serial(
                att, q, key_caches[i], value_caches[i], block_tables, context_lens, scale, attention_nkv, window
            )
        for r in range(M):
            for c in range(q_dim):
                att_rows[r, c] = att_flat[r * q_dim + c]
        _linear(att_rows, o_proj[i], h, max_chunks)
        cpu._add_rms_norm_rows(h[:M], residual, post_norms[i], eps, x)
        _linear(x, gate_up_proj[i], gate_up, max_chunks)
        cpu._silu_and_mul_rows(gate_up, act)
        _linear(act, down_proj[i], h, max_chunks)
    cpu._add_rms_norm_rows(h[:M], residual, final_norm, eps, out)


def _weight_entry(w):
    """A linear weight as the compiled step takes it (module docstring)."""
    if isinstance(w, cpu_quant.RepackedQuantized):
        qs, scales, mins = cpu_quant._planes(w)
        return (cpu_quant._FMT[w.qtype], qs, scales, mins)
    return w


def _typed_list(items):
    """A ``numba.typed.List`` of ``items``, or None when they do not share one Numba type."""
    if len({nb.typeof(item) for item in items}) != 1:
        return None
    return typed.List(items)


class CPUFusedDecode:
    """Runs the decoder layers of a pure-decode step of up to ``max_batch_size`` rows in one compiled
    call (module docstring).

    Args:
        model: a ``LlamaModel`` on the ``CPUBackend``.
        key_caches, value_caches: the runner's per-layer caches ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` (float32 or bfloat16), read and written in place.
        max_batch_size: decode steps with more rows run op by op (``cpu_gemm.SMALL_M``: above it the
            backend's products go to BLAS).
    Raises:
        ValueError: for a model not on the CPU backend.
    """

    def __init__(self, model, key_caches, value_caches, max_batch_size: int = cpu_gemm.SMALL_M):
        if model.backend.name != "cpu":
            raise ValueError(f"CPUFusedDecode runs on the cpu backend, not {model.backend.name}")
        self.model = model
        self.max_batch_size = max_batch_size
        cfg = model.config
        layers = model.layers
        self._caches = (
            typed.List([cpu._cache_view(c)[0] for c in key_caches]),
            typed.List([cpu._cache_view(c)[0] for c in value_caches]),
        )

        def weights(name):
            return _typed_list([_weight_entry(layer[name]) for layer in layers])

        def optional(name):
            present = [layer[name] for layer in layers if layer[name] is not None]
            if present:
                return typed.List(present)
            return typed.List.empty_list(nb.float32[::1])

        self._weights = (
            typed.List([layer["input_layernorm"] for layer in layers]),
            typed.List([layer["post_attention_layernorm"] for layer in layers]),
            weights("qkv_proj"),
            optional("qkv_bias"),
            optional("q_norm"),
            optional("k_norm"),
            weights("o_proj"),
            weights("gate_up_proj"),
            weights("down_proj"),
        )
        self.supported = all(w is not None for w in self._weights)
        self._eps = np.float32(cfg.rms_norm_eps)
        self._scale = np.float32(model.scale)
        self._window = sliding_window_arg(model.sliding_window)
        #: attention takes the parallel kernel from this much work (query rows x positions; module docstring)
        self.parallel_attention_min_work = 0

    def can_run(self, num_decodes: int) -> bool:
        """Whether a pure-decode step of ``num_decodes`` rows runs here."""
        return self.supported and 0 < num_decodes <= self.max_batch_size

    def forward(self, input_ids, positions, attn):
        """Final-norm hidden states float32 ``[M, hidden]`` of a pure-decode step, as
        ``LlamaModel.forward(input_ids, positions, attn, key_caches, value_caches)`` returns them.

        input_ids, positions: int64 ``[M]``; attn: ``AttentionMetadata`` with ``num_decode_tokens == M``.
        Raises ValueError for a step that is not pure decode."""
        M = input_ids.shape[0]
        if attn.num_decode_tokens != M:
            raise ValueError(f"a fused decode step takes decode rows only: {attn.num_decode_tokens} of {M}")
        model, cfg = self.model, self.model.config
        residual = np.ascontiguousarray(model.backend.embedding(input_ids, model.embed_tokens))
        out = np.empty_like(residual)
        num_kv_heads = cfg.num_key_value_heads
        context = int(attn.max_context_len) or attn.decode_block_tables.shape[1] * self._caches[0][0].shape[1]
        parallel = M * cfg.num_attention_heads * context >= self.parallel_attention_min_work
        _decode_layers(
            residual,
            np.ascontiguousarray(positions, dtype=np.int64),
            attn.slot_mapping,
            attn.decode_block_tables,
            attn.decode_context_lens,
            *self._caches,
            *self._weights,
            model.norm,
            model.cos_sin_cache,
            self._eps,
            self._scale,
            self._window,
            cfg.num_attention_heads,
            cfg.intermediate_size,
            cpu._kv_heads_per_task(M, num_kv_heads),
            parallel,
            4 * nb.get_num_threads(),
            out,
        )
        return out
