"""The CPU kernels composed into one compiled pass over a Llama-family or Gemma model's decoder layers, for
decode rows: what ``models.llama.LlamaModel.forward`` (or ``models.gemma.GemmaModel.forward``) does op by op,
in one Numba call (``model_executor.cpu_fused_decode`` runs pure-decode steps through it).

It calls the kernels the backend's ops call (``gemm._gemv_nt``/``_gemm_nt``, ``quant``'s GEMVs and
row products, ``elementwise``'s ``rms_norm_rows``/``add_rms_norm_rows``, ``rotate_half``,
``silu_and_mul_rows`` and ``gelu_tanh_and_mul_rows``, ``cache``'s writes, ``attention.paged_attention_*``,
``paged_attention_v2``),
on the same inputs and in the same order, so its hidden states equal the op-by-op forward's bit for bit.
Activations are sized once per call; x rows are padded to a multiple of ``gemm.TILE_M`` (zero rows, as
``gemm.pad_rows`` pads them) for the products.

Weights and caches come as ``numba.typed.List``s (one entry per layer) of the arrays the model holds:
Numba compiles the pass once per combination of entry types (float32 or quantized per projection, float32
or bf16 caches).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types as nb_types
from numba.extending import overload

from rawpaged.kernels.cpu import attention, cache, elementwise, gemm, paged_attention_v2, quant, quant_weights

_JIT = dict(cache=True, nogil=True)


def _linear(x, w, out, max_chunks):
    """Compiled code only: the overload below gives its body."""


@overload(_linear, jit_options=_JIT)
def _linear_impl(x, w, out, max_chunks):
    """``out [Mp, N] = x [Mp, K] @ W.T`` as ``CPUBackend.linear`` computes it for those rows: a float32
    ``W [N, K]`` through ``gemm.gemm_nt_into``, a quantized one given as ``linear_weight``'s parts
    through ``quant.rows_into``, part by part into their columns."""
    if isinstance(w, nb_types.Array):
        return lambda x, w, out, max_chunks: gemm.gemm_nt_into(x, w, out)

    def quantized(x, w, out, max_chunks):
        if w[1][0] < 0:  # one part: all of out's columns
            p = w[0]
            quant.rows_into(p[0], x, p[3], p[4], p[5], p[6], p[7], out, max_chunks)
            return
        for p in w:
            if p[0] >= 0:
                part = np.empty((x.shape[0], p[2]), np.float32)
                quant.rows_into(p[0], x, p[3], p[4], p[5], p[6], p[7], part, max_chunks)
                out[:, p[1] : p[1] + p[2]] = part

    return quantized


def _write_kv(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
    """Compiled code only: the overload below gives its body."""


@overload(_write_kv, jit_options=_JIT)
def _write_kv_impl(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
    """``cache.reshape_and_cache`` for float32 caches, bf16 caches seen as their uint16 bits, and int8 or
    fp8 (uint8 bits) caches with their scales."""
    if key_cache.dtype == nb_types.uint16:

        def bf16(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
            key_bits, value_bits = key.view(np.uint32), value.view(np.uint32)
            cache.reshape_and_cache_bf16(key_bits, value_bits, key_cache, value_cache, slot_mapping)

        return bf16
    if key_cache.dtype in (nb_types.int8, nb_types.uint8):

        def quantized(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
            cache.reshape_and_cache_quantized(
                key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax
            )

        return quantized

    def f32(key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, qmax):
        cache.reshape_and_cache_f32(key, value, key_cache, value_cache, slot_mapping)

    return f32


@nb.njit(**_JIT)
def decode_layers(
    residual,
    positions,
    slot_mappings,
    block_tables,
    context_lens,
    layer_groups,
    key_caches,
    value_caches,
    key_scales,
    value_scales,
    kv_qmax,
    input_norms,
    attn_out_norms,
    mlp_norms,
    mlp_out_norms,
    qkv_proj,
    qkv_bias,
    q_norms,
    k_norms,
    o_proj,
    gate_up_proj,
    down_proj,
    final_norm,
    cos_sin_caches,
    eps,
    scale,
    windows,
    soft_cap,
    gelu,
    num_heads,
    intermediate_size,
    attention_nkv,
    attention_partition,
    parallel_attention,
    max_chunks,
    out,
):
    """The decoder layers of a Llama-family or Gemma model for M decode rows, then the final norm.

    Args:
        residual: float32 ``[M, hidden]``, the (scaled) token embeddings; updated in place (the residual
            stream).
        positions: int64 ``[M]``. slot_mappings, block_tables, context_lens: typed lists, one entry per KV
            cache group, of int64 ``[M]``, int32 ``[M, max_blocks]`` and int32 ``[M]`` (as
            ``attention.paged_attention`` takes them); layer_groups: int64 ``[num_layers]``, each layer's group.
        key_caches, value_caches, key_scales, value_scales: typed lists of each layer's cache values and
            scales (``cache_view``), written in place; kv_qmax: float32, a quantized cache's ``qmax``.
        input_norms, mlp_norms: typed lists of float32 ``[hidden]``, the norms before attention and before
            the MLP; attn_out_norms, mlp_out_norms: the norms of the attention's and the MLP's outputs
            (Gemma's post-attention and post-feed-forward norms), or empty (none); final_norm: float32
            ``[hidden]``.
        qkv_proj, o_proj, gate_up_proj, down_proj: typed lists of ``linear_weight`` entries.
        qkv_bias, q_norms, k_norms: typed lists, one per layer, or empty (no bias / no q-k norm).
        cos_sin_caches: typed list of each layer's float32 ``[max_position, head_dim]`` RoPE table; eps,
            scale: float32; windows: int64 ``[num_layers]``, the attention kernels' ``sliding_window``
            argument per layer (0: none); soft_cap: float32, the attention scores' soft cap (0: none);
            gelu: the MLP's gate is the tanh GeLU (Gemma's GeGLU), else SiLU; num_heads,
            intermediate_size: ints.
        attention_nkv: KV heads per attention task (``attention.kv_heads_per_task``); attention_partition:
            positions per partition of a split context (``paged_attention_v2.decode_partition``; 0: none);
            parallel_attention: the thread-parallel attention kernel or the serial one (the same results).
        max_chunks: chunks of the quantized row products (as ``quant.quant_linear`` sizes them).
        out: float32 ``[M, hidden]``, written.
    Math: ``models.llama.LlamaModel.forward`` or ``models.gemma.GemmaModel.forward``, step for step, on the
    kernels named in the module docstring."""
    M, H = residual.shape
    Mp = 1 if M == 1 else -(-M // gemm.TILE_M) * gemm.TILE_M
    num_kv_heads, head_dim = key_caches[0].shape[2], key_caches[0].shape[3]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    has_bias = len(qkv_bias) == len(qkv_proj)
    has_qk_norm = len(q_norms) == len(qkv_proj)
    sandwich = len(attn_out_norms) == len(qkv_proj)
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
    normed = np.empty((M, H), np.float32)  # an output's norm, as the op by op forward's new array
    q_rows, q_flat = q.reshape((M * num_heads, head_dim)), q.reshape(M * q_dim)
    k_rows, k_flat, v_flat = k.reshape((M * num_kv_heads, head_dim)), k.reshape(M * kv_dim), v.reshape(M * kv_dim)
    att_flat = att.reshape(M * q_dim)
    for i in range(len(qkv_proj)):
        if i == 0:
            elementwise.rms_norm_rows(residual, input_norms[i], eps, x)
        else:
            elementwise.add_rms_norm_rows(h[:M], residual, input_norms[i], eps, x)
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
            elementwise.rms_norm_rows(q_rows, q_norms[i], eps, q_rows)
            elementwise.rms_norm_rows(k_rows, k_norms[i], eps, k_rows)
        elementwise.rotate_half(positions, q, cos_sin_caches[i])
        elementwise.rotate_half(positions, k, cos_sin_caches[i])
        kc, vc, ks, vs = key_caches[i], value_caches[i], key_scales[i], value_scales[i]
        g = layer_groups[i]
        _write_kv(k, v, kc, vc, ks, vs, slot_mappings[g], kv_qmax)
        tables, lens, window = block_tables[g], context_lens[g], windows[i]
        nkv, part = attention_nkv, attention_partition
        if part > 0 and parallel_attention:
            paged_attention_v2.paged_attention_v2_parallel(
                att, q, kc, vc, ks, vs, tables, lens, scale, nkv, window, soft_cap, part
            )
        elif part > 0:
            paged_attention_v2.paged_attention_v2_serial(
                att, q, kc, vc, ks, vs, tables, lens, scale, nkv, window, soft_cap, part
            )
        elif parallel_attention:
            attention.paged_attention_parallel(att, q, kc, vc, ks, vs, tables, lens, scale, nkv, window, soft_cap)
        else:
            attention.paged_attention_serial(att, q, kc, vc, ks, vs, tables, lens, scale, nkv, window, soft_cap)
        for r in range(M):
            for c in range(q_dim):
                att_rows[r, c] = att_flat[r * q_dim + c]
        _linear(att_rows, o_proj[i], h, max_chunks)
        if sandwich:
            elementwise.rms_norm_rows(h[:M], attn_out_norms[i], eps, normed)
            h[:M] = normed
        elementwise.add_rms_norm_rows(h[:M], residual, mlp_norms[i], eps, x)
        _linear(x, gate_up_proj[i], gate_up, max_chunks)
        if gelu:
            elementwise.gelu_tanh_and_mul_rows(gate_up, act)
        else:
            elementwise.silu_and_mul_rows(gate_up, act)
        _linear(act, down_proj[i], h, max_chunks)
        if sandwich:
            elementwise.rms_norm_rows(h[:M], mlp_out_norms[i], eps, normed)
            h[:M] = normed
    elementwise.add_rms_norm_rows(h[:M], residual, final_norm, eps, out)


#: parts of a quantized linear weight as ``decode_layers`` takes it (a fused QKV has three)
MAX_PARTS = 3


def linear_weight(w):
    """A linear weight as ``decode_layers`` takes it: a float32 ``[out, in]`` array as it is; a quantized
    one (``quant_weights.RepackedQuantized`` or ``StackedQuantized``) as ``MAX_PARTS`` tuples ``(format,
    first row, rows, qs, qh, scales, mins, sub)``, unused ones with format -1, so every layer's entry
    has one Numba type whatever its parts' formats.

    Raises ValueError for more than ``MAX_PARTS`` parts."""
    if isinstance(w, quant_weights.RepackedQuantized):
        parts = (w,)
    elif isinstance(w, quant_weights.StackedQuantized):
        parts = w.parts
    else:
        return w
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a quantized weight of {len(parts)} parts (at most {MAX_PARTS})")
    entries, row = [], 0
    for p in parts:
        entries.append((quant._FMT[p.qtype], row, p.shape[0], *quant_weights.kernel_planes(p)))
        row += p.shape[0]
    empty = (-1, 0, 0, *quant_weights.kernel_planes(parts[0]))
    return tuple(entries) + (empty,) * (MAX_PARTS - len(entries))


def cache_view(kv_cache) -> tuple:
    """A KV cache as ``decode_layers`` takes it: ``(values, scales)`` (``cache.cache_view``)."""
    return cache.cache_view(kv_cache)


def attention_tasks(num_seqs: int, num_kv_heads: int) -> tuple:
    """``decode_layers``' ``(attention_nkv, attention_partition)``: KV heads per attention task and the
    split of long contexts, as ``attention.paged_attention`` picks them."""
    nkv = attention.kv_heads_per_task(num_seqs, num_kv_heads)
    return nkv, paged_attention_v2.decode_partition(num_seqs, num_kv_heads)


def max_chunks() -> int:
    """``decode_layers``' ``max_chunks``: what ``quant.quant_linear`` passes (Numba's thread count,
    read here because reading it inside compiled code keeps the code from being cached)."""
    return 4 * nb.get_num_threads()
