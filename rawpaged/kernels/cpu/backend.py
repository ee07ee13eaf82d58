"""The CPU backend: ``CPUBackend``, the ``Backend`` contract (``rawpaged.kernels.backend``) over the
kernels of this package (Numba and NumPy), arrays and weight loading.

Its kernels, one job a module: ``cache`` (KV writes, block copies), ``attention`` and ``prefill_tiled``
(paged attention), ``elementwise`` (RMSNorm, RoPE, SwiGLU, GeGLU), ``gemm`` (float32 products for few rows),
``quant`` (GGUF block-quantized products), ``sampling`` (bitmask and sampler), ``fused_decode`` (a decode
step's layers in one compiled call), ``moe`` (mixture-of-experts routing and grouped expert products).
"""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cpu.attention import paged_attention, prefill_attention
from rawpaged.kernels.cpu.cache import copy_blocks, reshape_and_cache, rotary_embedding_and_cache
from rawpaged.kernels.cpu.elementwise import gelu_tanh_and_mul, rms_norm, rotary_embedding, silu_and_mul
from rawpaged.kernels.cpu.gemm import SMALL_M, gemm_nt
from rawpaged.kernels.cpu.logprobs import logprob_rows
from rawpaged.kernels.cpu.moe import grouped_linear, load_experts, moe_align, moe_combine, moe_route
from rawpaged.kernels.cpu.moe_quant import RepackedExperts, StackedExperts, grouped_quant_linear, repack_experts
from rawpaged.kernels.cpu.quant import quant_embedding, quant_linear
from rawpaged.kernels.cpu.quant_weights import RepackedQuantized, StackedQuantized, repack
from rawpaged.kernels.cpu.sampling import apply_logits_edits, apply_token_bitmask, sample
from rawpaged.kernels.kv_cache import allocate_kv_cache
from rawpaged.kernels.quantization import QuantizedExperts, QuantizedTensor

DEFAULT_KV_CACHE_MEMORY = 1 << 30


def _check_cpu_dtype(dtype: str) -> None:
    if dtype != "float32":
        raise ValueError(f"dtype {dtype!r} is not supported on the CPU backend (float32 only)")


class CPUBackend:
    """The CPU kernels behind the backend interface the model calls (same names as ``CudaBackend``).

    Arrays are NumPy; activations float32; linear weights ``[out, in]`` as checkpoints store them;
    matmuls through NumPy's BLAS, or Numba kernels for few rows (``gemm``) and for quantized weights
    (``quant``).
    """

    name = "cpu"
    xp = np
    dtype_pairs = (("float32", "float32"), ("float32", "bfloat16"), ("float32", "int8"), ("float32", "fp8_e4m3"))
    #: no graphs to capture: a decode step on static buffers runs kernel by kernel (``cuda_graph``)
    supports_cuda_graphs = False
    #: the mixture-of-experts ops (``moe``): float32 experts

    @staticmethod
    def auto_dtype(checkpoint_dtype: str | None) -> str:
        """float32, the CPU's only activation dtype."""
        return "float32"

    @staticmethod
    def default_kv_cache_memory(gpu_memory_utilization: float) -> int:
        """1 GiB, whatever the GPU setting."""
        return DEFAULT_KV_CACHE_MEMORY

    reshape_and_cache = staticmethod(reshape_and_cache)
    rotary_embedding_and_cache = staticmethod(rotary_embedding_and_cache)
    paged_attention = staticmethod(paged_attention)
    prefill_attention = staticmethod(prefill_attention)
    copy_blocks = staticmethod(copy_blocks)
    rms_norm = staticmethod(rms_norm)
    rotary_embedding = staticmethod(rotary_embedding)
    silu_and_mul = staticmethod(silu_and_mul)
    gelu_tanh_and_mul = staticmethod(gelu_tanh_and_mul)
    sample = staticmethod(sample)  # ``rawpaged.testing.reference_sampler.sample`` is its reference
    apply_token_bitmask = staticmethod(apply_token_bitmask)
    apply_logits_edits = staticmethod(apply_logits_edits)
    logprob_rows = staticmethod(logprob_rows)
    moe_route = staticmethod(moe_route)
    moe_align = staticmethod(moe_align)
    moe_combine = staticmethod(moe_combine)

    @staticmethod
    def zeros(shape, dtype):
        """A zero-filled array (KV caches); ``dtype`` may be ``ml_dtypes.bfloat16``. Every page is written
        now (``np.zeros`` maps pages lazily), so the pool's memory is committed at start-up and the first
        request to touch a block pays no page faults (3 ms per layer for a 512-token prefill otherwise)."""
        a = np.empty(shape, dtype=dtype)
        a.fill(0)
        return a

    @classmethod
    def allocate_kv_cache(cls, shape, kv_cache_dtype: str):
        """A zeroed cache of ``kv_cache_dtype`` (``kv_cache.allocate_kv_cache``), its pages committed (``zeros``)."""
        return allocate_kv_cache(cls.zeros, shape, kv_cache_dtype)

    @staticmethod
    def asarray(x, dtype=None):
        """Host array -> backend array (a no-op view where possible)."""
        return np.asarray(x, dtype=dtype)

    @staticmethod
    def to_numpy(x):
        return np.asarray(x)

    @staticmethod
    def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
        """A fused QKV projection ``[num_tokens, (num_heads + 2 num_kv_heads) head_dim]`` as contiguous
        ``q [T, num_heads, D]``, ``k``, ``v [T, num_kv_heads, D]`` copies (the Numba kernels are compiled
        for contiguous arrays)."""
        T, hq, hk = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        return (
            np.ascontiguousarray(qkv[:, :hq]).reshape(T, num_heads, head_dim),
            np.ascontiguousarray(qkv[:, hq : hq + hk]).reshape(T, num_kv_heads, head_dim),
            np.ascontiguousarray(qkv[:, hq + hk :]).reshape(T, num_kv_heads, head_dim),
        )

    @staticmethod
    def upload(dst, host) -> None:
        """Copy ``host``'s bytes into C-contiguous ``dst`` (same nbytes): the CUDA backend's one
        host-to-device copy, here a memory copy."""
        dst.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)

    def __init__(self):
        # id(host tensor) -> (it, what it became) while a model loads: a tied embedding and LM head
        # share one array (float32) or one repacked copy (quantized)
        self._loaded = {}

    def _once(self, host, convert):
        if id(host) not in self._loaded:
            self._loaded[id(host)] = (host, convert(host))
        return self._loaded[id(host)][1]

    def load_weight(self, host, dtype: str = "float32"):
        """A host tensor (any float dtype, e.g. a memory-mapped safetensors view) -> a C-contiguous
        float32 copy in NumPy's own memory, which NumPy backs with transparent huge pages where the
        kernel allows (a memory-mapped file's 4 KiB pages made batch-1 decode up to 20% slower, from TLB
        misses); a ``QuantizedTensor`` (an embedding table) stays in its blocks, repacked
        (``quant``)."""
        _check_cpu_dtype(dtype)
        if isinstance(host, QuantizedTensor):
            return self._once(host, repack)
        return self._once(host, lambda h: np.array(h, dtype=np.float32, order="C"))

    def load_linear(self, parts: list, dtype: str = "float32"):
        """HF ``[out_i, in]`` weights fused along ``out`` -> one C-contiguous float32 ``[sum out_i, in]``
        (the layout ``linear`` takes); ``QuantizedTensor`` parts of one format stay in their blocks (rows
        concatenated, then repacked: ``quant_weights.RepackedQuantized``), parts of different formats too, stacked
        (``quant_weights.StackedQuantized``); quantized parts mixed with float ones are dequantized. A single part
        already loaded (a tied LM head) is the same array."""
        _check_cpu_dtype(dtype)
        if len(parts) == 1:
            return self.load_weight(parts[0], dtype)
        if all(isinstance(p, QuantizedTensor) for p in parts):
            if len({p.qtype for p in parts}) == 1:
                return repack(QuantizedTensor.concat(parts))
            return StackedQuantized.from_parts(parts)
        parts = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
        return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])

    def load_experts(self, parts: list, dtype: str = "float32"):
        """A mixture of experts' stacked weights ``[E, N_i, K]`` fused along N (gate then up) -> the handle
        ``grouped_linear`` takes: ``QuantizedExperts`` parts stay in their blocks (``moe_quant.repack_experts``),
        float ones (ndarrays) become the float32 ``[E, sum N_i, K]`` of ``moe.load_experts``; quantized parts
        mixed with float ones are dequantized."""
        _check_cpu_dtype(dtype)
        if all(isinstance(p, QuantizedExperts) for p in parts):
            return repack_experts(parts)
        return load_experts([p.dequantize() if isinstance(p, QuantizedExperts) else p for p in parts])

    @staticmethod
    def grouped_linear(x, expert_offsets, experts):
        """``x [M, K]`` (rows sorted by expert) -> float32 ``[M, N]``: expert e's rows
        ``expert_offsets[e] .. expert_offsets[e + 1]`` times its weight transposed (``x @ W_e.T``), for a
        ``load_experts`` handle; an expert with no rows is never read. Quantized experts through
        ``moe_quant.grouped_quant_linear``, float ones through ``moe.grouped_linear`` (one compiled call each)."""
        if isinstance(experts, (RepackedExperts, StackedExperts)):
            out = np.empty((x.shape[0], experts.shape[1]), np.float32)
            return grouped_quant_linear(x, expert_offsets, experts, out)
        return grouped_linear(x, expert_offsets, experts)

    def finish_loading(self):
        """Forget the host tensors seen while loading (their memory can be freed)."""
        self._loaded.clear()

    @staticmethod
    def linear(x, weight, bias=None, float32_out=False):
        """``x [M, in] @ weight.T (+ bias)`` -> float32 ``[M, out]`` for a weight ``[out, in]`` from
        ``load_linear``: float32 through ``gemm.gemm_nt`` for M <= ``gemm.SMALL_M`` (decode
        batches), through BLAS's SGEMM above; a ``RepackedQuantized`` weight through
        ``quant.quant_linear``. Always float32 (the CPU's only activation dtype), so ``float32_out``
        changes nothing."""
        if isinstance(weight, (RepackedQuantized, StackedQuantized)):
            y = quant_linear(x, weight)
        elif x.shape[0] <= SMALL_M:
            y = gemm_nt(x, weight)
        else:
            y = x @ weight.T
        if bias is not None:
            y += bias
        return y

    @staticmethod
    def embedding(token_ids, table, scale=None):
        """Rows of ``table [vocab, hidden]`` for ``token_ids [n]``, as float32 (a quantized table's rows
        are dequantized on lookup), times ``scale`` (a float, rounded to float32 first) unless None."""
        if isinstance(table, RepackedQuantized):
            rows = quant_embedding(token_ids, table)
        else:
            rows = table[token_ids].astype(np.float32, copy=False)
        if scale is not None:
            rows = rows * np.float32(scale)
        return rows
