"""CUDA backend: the kernels of ``cuda/*.cu`` through ``cupy.RawModule``, the rest through CuPy/cuBLAS.

Same names and semantics as :class:`rawpaged.kernels.cpu.CPUBackend` (see that module for the math and
its sources); the kernels themselves are documented in ``cuda/attention.cu``, ``cuda/cache.cu`` and
``cuda/layers.cu``. Differences, all additive:

* dtypes: activations (query/out/x/...) may be float32, float16 or bfloat16, KV caches float32, float16
  or bfloat16, in the combinations of :data:`cuda_sources.DTYPE_PAIRS`. CuPy has no bfloat16, so a
  bfloat16 tensor is a CuPy ``uint16`` array holding the bit patterns (:meth:`asarray` converts
  ``ml_dtypes.bfloat16`` host arrays, :meth:`to_numpy` converts back). Math is float32 throughout.
* ``paged_attention(..., max_context_len=None)``: an upper bound on ``context_lens`` known on the host (it
  sizes the flash-decoding partitions); default ``block_tables.shape[1] * block_size``.
* ``prefill_attention(..., max_query_len=None)``: an upper bound on new tokens per sequence; default from
  ``query_start_loc`` when it is a host array, else ``num_tokens``.
* ``linear``: float32/float16 through ``x @ weight.T`` (cuBLAS via CuPy); bfloat16 (``uint16`` storage)
  through ``cublasGemmEx`` with CUDA_R_16BF inputs/outputs and float32 accumulation (CUBLAS_COMPUTE_32F).
* ``embedding`` returns rows in the table's dtype (float32 tables give float32, as on the CPU).
* GGUF Q8_0/Q4_0/Q4_1 weights stay in their blocks (:class:`DeviceQuantized`): ``linear`` runs
  ``quant_gemv_kernel`` (up to 8 rows of x) or ``quant_gemm_kernel`` (tiles), ``embedding`` dequantizes
  rows on lookup (``cuda/quant.cu``).

Only this module imports CuPy, and only when a :class:`CudaBackend` is created: a CPU-only install never
imports it. Compile options and template instantiations come from :mod:`rawpaged.kernels.cuda_sources`,
shared with the NVRTC compile test and the CPU emulation tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from rawpaged.dtypes import BFLOAT16, FLOAT32, FLOAT_TYPES, float_type, float_type_of
from rawpaged.kernels import cublas
from rawpaged.kernels import cuda_sources as src
from rawpaged.kernels.backend import check_block_mapping, sliding_window_arg
from rawpaged.kernels.quantization import QuantizedTensor

#: device memory kept out of the KV pool for what a step allocates beside it: activations (for the default
#: model at 2048 batched tokens, tens of MB), sampled rows' float32 logits, cuBLAS's workspace
ACTIVATION_HEADROOM_BYTES = 1 << 30

_BF16 = BFLOAT16.numpy
#: Device storage dtype -> C++ element type.
_CTYPES = {t.device: t.cxx for t in FLOAT_TYPES.values()}
_DEFAULT_SMEM = 48 * 1024

# cuBLAS / CUDA enum values: rawpaged.kernels.cublas
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = cublas.CUDA_R_32F, cublas.CUDA_R_16F, cublas.CUDA_R_16BF
_CUBLAS_COMPUTE_32F = cublas.COMPUTE_32F
_CUBLAS_GEMM_DEFAULT = cublas.GEMM_DEFAULT
_MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


@functools.cache
def _instantiated(act: str, cache: str) -> frozenset:
    return frozenset(src.name_expressions(act, cache))


def _ctype(a, what: str) -> str:
    try:
        return _CTYPES[np.dtype(a.dtype)]
    except KeyError:
        raise ValueError(f"{what} dtype must be float32, float16 or bfloat16 (uint16 bits), got {a.dtype}") from None


def _i32(v) -> np.int32:
    return np.int32(v)


def _i64(v) -> np.int64:
    return np.int64(v)


@dataclass(frozen=True)
class DeviceQuantized:
    """A GGUF block-quantized ``[rows, cols]`` weight on the device: the planes of a ``QuantizedTensor``
    (``qs`` uint8, ``scales``/``mins`` uint16 fp16 bits; ``mins`` is ``scales`` for formats without a
    minimum, never read), computed on by the kernels of ``cuda/quant.cu``. ``dtype`` is the activation
    storage dtype its products take and give."""

    qtype: str
    shape: tuple
    qs: Any
    scales: Any
    mins: Any
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        extra = self.mins.nbytes if self.mins is not self.scales else 0
        return int(self.qs.nbytes + self.scales.nbytes + extra)


def _row_stride(a, what: str, inner_dims: int) -> int:
    """Element stride of axis 0 of ``a``, checking that the last ``inner_dims`` axes are contiguous."""
    item = a.dtype.itemsize
    expect = item
    for ax in range(a.ndim - 1, a.ndim - 1 - inner_dims, -1):
        if a.shape[ax] > 1 and a.strides[ax] != expect:
            raise ValueError(f"{what}: the last {inner_dims} axes must be contiguous (strides {a.strides})")
        expect *= a.shape[ax]
    if a.strides[0] % item:
        raise ValueError(f"{what}: misaligned stride {a.strides}")
    return a.strides[0] // item if a.shape[0] > 1 else int(np.prod(a.shape[1:]))


def _check_cache_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Raises ValueError unless K/V rows ``[num_tokens, num_kv_heads, head_dim]`` of one dtype fit C-contiguous
    caches of one shape and dtype, with one ``slot_mapping`` entry per token."""
    if key.shape != value.shape or key.dtype != value.dtype or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {key.shape} / value {value.shape} do not match cache {key_cache.shape}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous):
        raise ValueError("KV caches must be C-contiguous")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def _check_rope(query, key, cos_sin_cache) -> None:
    """Raises ValueError unless query ``[T, H, D]`` and key ``[T, Hkv, D]`` share T, D and dtype and
    ``cos_sin_cache`` is float32 ``[max_position, D]``."""
    if key.dtype != query.dtype or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]:
        raise ValueError(f"query {query.shape}/{query.dtype} and key {key.shape}/{key.dtype} disagree")
    if cos_sin_cache.dtype != np.float32 or cos_sin_cache.shape[-1] != query.shape[2]:
        raise ValueError("cos_sin_cache must be float32 [max_position, head_dim]")


def _host_byte_copy(dst, host) -> None:
    """``copy_to_device`` for array modules whose arrays live on the host (the emulation tests)."""
    dst.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)


class _CupyLauncher:
    """Compiles one RawModule per (activation, cache) dtype pair on first use and launches its kernels."""

    def __init__(self, cupy):
        self._cupy = cupy
        self._modules: dict[tuple[str, str], object] = {}
        self._functions: dict[tuple[str, str, str], object] = {}

    def module(self, act: str, cache: str):
        key = (act, cache)
        if key not in self._modules:
            self._modules[key] = self._cupy.RawModule(
                code=src.module_source(),
                options=src.RUNTIME_OPTIONS + src.include_options(),
                name_expressions=src.name_expressions(act, cache),
            )
        return self._modules[key]

    def __call__(self, act, cache, name, grid, block, args, smem_bytes=0):
        key = (act, cache, name)
        fn = self._functions.get(key)
        if fn is None:
            fn = self.module(act, cache).get_function(name)
            self._functions[key] = fn
        if smem_bytes > _DEFAULT_SMEM and fn.max_dynamic_shared_size_bytes < smem_bytes:
            fn.max_dynamic_shared_size_bytes = smem_bytes
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=int(smem_bytes))

    def static_smem_bytes(self, act, cache, name) -> int:
        """The kernel's static ``__shared__`` bytes, as the driver reports them."""
        key = (act, cache, name)
        if key not in self._functions:
            self._functions[key] = self.module(act, cache).get_function(name)
        return int(getattr(self._functions[key], "shared_size_bytes", src.SAMPLE_STATIC_SMEM_BYTES))

    def address(self, a) -> int:
        return int(a.data.ptr)


class PinnedStager:
    """Host -> device copies through two page-locked (pinned) staging buffers.

    The driver DMA-copies pinned memory asynchronously; pageable memory (a memory-mapped safetensors
    file) it would first copy into its own staging area, synchronously. Here each chunk is read from
    the host array into one buffer while the previous chunk's copy from the other is in flight; an
    event per buffer says when it may be refilled. Copies go on the current stream, so kernels launched
    after them (the dtype conversion) see the data.

    Args:
        cupy: the CuPy module (or an object with the same ``cuda`` API, for tests).
        chunk_bytes: size of each of the two buffers.
    """

    def __init__(self, cupy, chunk_bytes: int = 32 << 20):
        self._cupy = cupy
        self.chunk_bytes = int(chunk_bytes)
        self._buffers = [cupy.cuda.alloc_pinned_memory(self.chunk_bytes) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0
        self.bytes_copied = 0

    def copy(self, dst, host) -> None:
        """Copy the bytes of NumPy array ``host`` into C-contiguous device array ``dst`` (same nbytes)."""
        src = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        if src.nbytes != dst.nbytes or not dst.flags.c_contiguous:
            raise ValueError(
                f"staged copy of {src.nbytes} bytes into a {dst.nbytes}-byte device array "
                f"(contiguous: {dst.flags.c_contiguous})"
            )
        cuda = self._cupy.cuda
        stream = cuda.get_current_stream()
        for off in range(0, src.nbytes, self.chunk_bytes):
            n = min(self.chunk_bytes, src.nbytes - off)
            i, self._turn = self._turn, self._turn ^ 1
            if self._events[i] is not None:
                self._events[i].synchronize()
            staging = np.frombuffer(self._buffers[i], dtype=np.uint8, count=n)
            staging[...] = src[off : off + n]
            cuda.runtime.memcpyAsync(dst.data.ptr + off, staging.ctypes.data, n, _MEMCPY_HOST_TO_DEVICE, stream.ptr)
            self._events[i] = stream.record()
        self.bytes_copied += src.nbytes

    def close(self) -> None:
        """Wait for the copies in flight and release the pinned buffers."""
        for e in self._events:
            if e is not None:
                e.synchronize()
        self._events = [None, None]
        self._buffers = []


class CudaBackend:
    """The CUDA kernels behind the backend interface the model calls (same names as ``CPUBackend``).

    Args:
        device: CUDA device ordinal (default: CuPy's current device).
    Raises:
        RuntimeError: ``"no CUDA device found: ..."`` when CuPy is missing or sees no usable GPU.
    """

    name = "cuda"
    dtype_pairs = src.DTYPE_NAME_PAIRS

    @staticmethod
    def auto_dtype(checkpoint_dtype: str | None) -> str:
        """The checkpoint's float16/bfloat16, else bfloat16 (vLLM picks float16 for float32 checkpoints;
        bfloat16 keeps float32's exponent range)."""
        return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"

    def __init__(self, device: int | None = None):
        try:
            import cupy  # deferred: an optional library (the cuda12/cuda13 extras)
        except Exception as e:  # ImportError, or a CUDA library that fails to load
            raise RuntimeError(f"no CUDA device found: CuPy is not importable ({e})") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, ...
            raise RuntimeError(f"no CUDA device found: {e}") from None
        if count < 1:
            raise RuntimeError("no CUDA device found: the CUDA runtime reports 0 devices")
        dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        dev.use()
        attrs = dev.attributes
        self.xp = cupy
        self.device = dev
        self.num_sms = int(attrs["MultiProcessorCount"])
        self.max_smem_optin = int(attrs.get("MaxSharedMemoryPerBlockOptin", _DEFAULT_SMEM))
        self._launch = _CupyLauncher(cupy)
        self._address = self._launch.address
        self._stager = None
        self._copy_to_device = self._staged_copy
        self._capture_blas = None
        self._graph_state = None

    @classmethod
    def _with_launcher(cls, xp, launch, address, num_sms: int, max_smem_optin: int = 227 * 1024, copy_to_device=None):
        """A backend over another array module and kernel launcher (the CPU emulation tests use NumPy and
        the g++-built kernels). ``launch(act, cache, name, grid, block, args, smem_bytes)``;
        ``copy_to_device(dst, host)`` moves a host array's bytes into a device array (default: a byte copy
        for array modules whose arrays live on the host)."""
        self = cls.__new__(cls)
        self.xp = xp
        self.device = None
        self.num_sms = num_sms
        self.max_smem_optin = max_smem_optin
        self._launch = launch
        self._address = address
        self._stager = None
        self._copy_to_device = copy_to_device or _host_byte_copy
        self._capture_blas = None
        self._graph_state = None
        return self

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether :meth:`capture_graph` can record launches (a real device; not the CPU emulation)."""
        return self.device is not None

    @staticmethod
    def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple:
        """A fused QKV projection ``[num_tokens, (num_heads + 2 num_kv_heads) head_dim]`` (C-contiguous) as
        views ``q [T, num_heads, D]``, ``k``, ``v [T, num_kv_heads, D]`` with the projection's token stride:
        the kernels that read them take strides, so no copy is made."""
        T, hq, hk = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        return (
            qkv[:, :hq].reshape(T, num_heads, head_dim),
            qkv[:, hq : hq + hk].reshape(T, num_kv_heads, head_dim),
            qkv[:, hq + hk :].reshape(T, num_kv_heads, head_dim),
        )

    def upload(self, dst, host) -> None:
        """Copy NumPy array ``host``'s bytes into C-contiguous device array ``dst`` (same nbytes), on the
        current stream: kernels launched after it, and graphs replayed after it, see the data."""
        self._copy_to_device(dst, host)

    def capture_graph(self, fn):
        """Record the kernels ``fn()`` launches as a CUDA graph; returns ``(replay, output)``:
        ``replay()`` relaunches them all on the current stream, ``output`` is what ``fn`` returned
        (device arrays the replays write again).

        ``fn`` runs twice on a private, non-default stream: once eagerly (compiles kernels, picks
        cuBLAS's algorithms, fills the graphs' memory pool) and once under capture (relaxed mode).
        Arrays ``fn`` allocates come from one memory pool kept for the graphs alone: what a graph's
        kernels read and write stays reserved for it, and graphs share those buffers (they never run
        concurrently). Products go through a cuBLAS handle bound to that stream
        (:mod:`rawpaged.kernels.cublas`). Everything ``fn`` reads must stay at the addresses it read them
        from (static input buffers), and ``fn`` must not synchronize with the host.

        Raises RuntimeError without a device (the emulation records no graph) or when capture fails.
        """
        if not self.supports_cuda_graphs:
            raise RuntimeError("CUDA graphs need a GPU: this backend emulates its kernels")
        xp = self.xp
        if self._graph_state is None:
            xp.cuda.device.get_cublas_handle()  # CuPy loads libcublas; load_library finds it in the process
            stream = xp.cuda.Stream(non_blocking=True)
            pool = xp.cuda.MemoryPool()
            workspace = xp.empty(cublas.WORKSPACE_BYTES, dtype=np.uint8)
            handle = cublas.CublasHandle(cublas.load_library(), stream.ptr, self._address(workspace), workspace.nbytes)
            self._graph_state = (stream, pool, workspace, handle)
        stream, pool, _, handle = self._graph_state
        xp.cuda.get_current_stream().synchronize()  # the inputs' uploads, on the current stream
        self._capture_blas = handle
        try:
            with xp.cuda.using_allocator(pool.malloc), stream:
                fn()
                stream.synchronize()
                stream.begin_capture()
                try:
                    output = fn()
                finally:
                    graph = stream.end_capture()
        finally:
            self._capture_blas = None

        def replay():
            graph.launch(stream=xp.cuda.get_current_stream())

        return replay, output

    # ------------------------------------------------------------------ helpers
    def _kernel(self, act, cache, name, grid, block, args, smem_bytes=0):
        if name not in _instantiated(act, cache):
            raise ValueError(
                f"kernel {name} is not instantiated for activations {act} / cache {cache}; "
                f"add it to rawpaged/kernels/cuda_sources.py"
            )
        if smem_bytes > self.max_smem_optin:
            raise ValueError(
                f"{name} needs {smem_bytes} bytes of shared memory per block; this GPU allows {self.max_smem_optin}"
            )
        self._launch(act, cache, name, grid, block, args, smem_bytes)

    def _dev(self, a, dtype):
        """``a`` as a contiguous device array of ``dtype`` (uploads host arrays)."""
        return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))

    @staticmethod
    def _check_attention(out, query, key_cache, value_cache, block_tables):
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out {out.shape}/{out.dtype} must match query {query.shape}/{query.dtype}")
        if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
            raise ValueError("key_cache and value_cache must have the same shape and dtype")
        if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous):
            raise ValueError("KV caches must be C-contiguous")
        num_heads, head_dim = query.shape[-2:]
        num_kv_heads = key_cache.shape[2]
        if head_dim != key_cache.shape[3] or num_heads % num_kv_heads:
            raise ValueError(f"query heads/head_dim {query.shape[-2:]} incompatible with cache {key_cache.shape}")
        if head_dim not in src.HEAD_DIMS:
            raise ValueError(
                f"head_dim {head_dim} not compiled; supported: {src.HEAD_DIMS} "
                f"(rawpaged/kernels/cuda_sources.py: HEAD_DIMS)"
            )
        if block_tables.ndim != 2:
            raise ValueError("block_tables must be int32 [num_seqs, max_blocks_per_seq]")
        block_size = key_cache.shape[1]
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two for the attention kernels, got {block_size}")

    # ------------------------------------------------------------------ paged KV kernels
    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        """Write new K/V rows into the paged caches (see ``cpu.reshape_and_cache``).

        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (activation dtype; token stride free, e.g. a
        view into a fused QKV output); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
        C-contiguous, written in place (float32 -> bf16/fp16 rounds to nearest even); slot_mapping int64
        ``[num_tokens]``, ``-1`` skips a token.
        """
        act, cache = _ctype(key, "key"), _ctype(key_cache, "key_cache")
        _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        slots = self._dev(slot_mapping, np.int64)
        threads = src.round_threads(num_kv_heads * head_dim, 512)
        self._kernel(
            act,
            cache,
            f"reshape_and_cache_kernel<{act}, {cache}>",
            (num_tokens, 1, 1),
            (threads, 1, 1),
            (
                key,
                value,
                key_cache,
                value_cache,
                slots,
                _i64(_row_stride(key, "key", 2)),
                _i64(_row_stride(value, "value", 2)),
                _i32(num_kv_heads),
                _i32(head_dim),
                _i32(key_cache.shape[1]),
            ),
        )

    def rotary_embedding_and_cache(
        self, positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache
    ) -> None:
        """``rotary_embedding`` of query and key, then ``reshape_and_cache`` of the rotated key and the
        value, in one kernel (``cuda/cache.cu``; same results bit for bit): query is rotated in place, key
        and value are only read (key is not rotated in place, unlike the CPU's composition). Arguments as
        those two methods take them; ``-1`` slots rotate the query only."""
        act, cache = _ctype(key, "key"), _ctype(key_cache, "key_cache")
        _check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        _check_rope(query, key, cos_sin_cache)
        num_tokens, num_heads, head_dim = query.shape
        if num_tokens == 0:
            return
        num_kv_heads = key.shape[1]
        work = max((num_heads + num_kv_heads) * head_dim // 2, num_kv_heads * head_dim)
        self._kernel(
            act,
            cache,
            f"rotary_embedding_and_cache_kernel<{act}, {cache}>",
            (num_tokens, 1, 1),
            (src.round_threads(work, 512), 1, 1),
            (
                self._dev(positions, np.int64),
                query,
                _i64(_row_stride(query, "query", 2)),
                key,
                _i64(_row_stride(key, "key", 2)),
                value,
                _i64(_row_stride(value, "value", 2)),
                key_cache,
                value_cache,
                self._dev(slot_mapping, np.int64),
                self.xp.ascontiguousarray(cos_sin_cache),
                _i32(num_heads),
                _i32(num_kv_heads),
                _i32(head_dim),
            ),
        )

    def paged_attention(
        self,
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len: int | None = None,
        sliding_window: int | None = None,
    ):
        """Decode attention, one query token per sequence (see ``cpu.paged_attention``).

        out/query ``[num_seqs, num_heads, head_dim]`` (same dtype; token stride free), caches
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, block_tables int32 ``[num_seqs, max_blocks]``,
        context_lens int32 ``[num_seqs]``. Flash-decoding split-K when the (sequence, KV head) grid is too
        small for the GPU: partitions from :func:`cuda_sources.decode_config`, merged by a second kernel.
        With ``sliding_window`` W, each query sees its last W positions; partitions cover only those.
        """
        self._check_attention(out, query, key_cache, value_cache, block_tables)
        window = sliding_window_arg(sliding_window)
        act, cache = _ctype(query, "query"), _ctype(key_cache, "key_cache")
        num_seqs, num_heads, head_dim = query.shape
        if num_seqs == 0:
            return
        _, block_size, num_kv_heads, _ = key_cache.shape
        bt = self._dev(block_tables, np.int32)
        ctx = self._dev(context_lens, np.int32)
        max_ctx = max_context_len if max_context_len is not None else bt.shape[1] * block_size
        if window:
            max_ctx = min(max_ctx, window)
        cfg = src.decode_config(num_seqs, num_heads, num_kv_heads, head_dim, max_ctx, self.num_sms)
        splits = cfg["num_splits"]
        null = np.uint64(0)
        part_out = part_ml = null
        if splits > 1:
            part_out = self.xp.empty((num_seqs, num_heads, splits, head_dim), dtype=np.float32)
            part_ml = self.xp.empty((num_seqs, num_heads, splits, 2), dtype=np.float32)
        out_stride = _i64(_row_stride(out, "out", 2))
        self._kernel(
            act,
            cache,
            f"paged_attention_kernel<{act}, {cache}, {head_dim}, {cfg['gmax']}>",
            cfg["grid"],
            cfg["block"],
            (
                out,
                out_stride,
                part_out,
                part_ml,
                query,
                _i64(_row_stride(query, "query", 2)),
                key_cache,
                value_cache,
                bt,
                _i32(bt.shape[1]),
                ctx,
                _i32(num_heads),
                _i32(num_kv_heads),
                _i32(block_size),
                np.float32(scale),
                _i32(cfg["split_len"]),
                _i32(splits),
                _i32(window),
            ),
            cfg["smem_bytes"],
        )
        if splits > 1:
            self._kernel(
                act,
                cache,
                f"paged_attention_reduce_kernel<{act}>",
                (num_heads, num_seqs, 1),
                cfg["reduce_block"],
                (
                    out,
                    out_stride,
                    part_out,
                    part_ml,
                    ctx,
                    _i32(num_heads),
                    _i32(head_dim),
                    _i32(splits),
                    _i32(cfg["split_len"]),
                    _i32(window),
                ),
            )

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
        max_query_len: int | None = None,
        sliding_window: int | None = None,
    ):
        """Causal attention of each sequence's new tokens over all its cached K/V (see
        ``cpu.prefill_attention``): plain prefill, prefill after a cached prefix, chunked prefill.

        out/query ``[num_tokens, num_heads, head_dim]``; query_start_loc int32 ``[num_seqs + 1]``;
        seq_lens int32 ``[num_seqs]``; the new tokens are each sequence's last positions. Host arrays for
        query_start_loc/seq_lens are validated like on the CPU; device arrays are trusted.
        """
        self._check_attention(out, query, key_cache, value_cache, block_tables)
        window = sliding_window_arg(sliding_window)
        act, cache = _ctype(query, "query"), _ctype(key_cache, "key_cache")
        num_tokens, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        num_seqs = block_tables.shape[0]
        if isinstance(query_start_loc, np.ndarray):
            qsl = query_start_loc.astype(np.int64)
            counts = np.diff(qsl)
            if len(qsl) != num_seqs + 1 or qsl[0] != 0 or qsl[-1] != num_tokens or (counts < 0).any():
                raise ValueError("query_start_loc must start at 0, be non-decreasing and end at num_tokens")
            if isinstance(seq_lens, np.ndarray) and (seq_lens < counts).any():
                raise ValueError("seq_lens must be >= the number of new tokens of each sequence")
            if max_query_len is None:
                max_query_len = int(counts.max(initial=0))
        if max_query_len is None:
            max_query_len = num_tokens
        if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
            return
        bt = self._dev(block_tables, np.int32)
        qsl_d = self._dev(query_start_loc, np.int32)
        lens_d = self._dev(seq_lens, np.int32)
        cfg = src.prefill_config(num_seqs, num_heads, num_kv_heads, head_dim, max_query_len)
        self._kernel(
            act,
            cache,
            f"prefill_attention_kernel<{act}, {cache}, {head_dim}>",
            cfg["grid"],
            cfg["block"],
            (
                out,
                _i64(_row_stride(out, "out", 2)),
                query,
                _i64(_row_stride(query, "query", 2)),
                key_cache,
                value_cache,
                bt,
                _i32(bt.shape[1]),
                qsl_d,
                lens_d,
                _i32(num_heads),
                _i32(num_kv_heads),
                _i32(block_size),
                np.float32(scale),
                _i32(cfg["heads_per_block"]),
                _i32(window),
            ),
            cfg["smem_bytes"],
        )

    def copy_blocks(self, key_caches, value_caches, block_mapping):
        """Copy whole blocks ``src -> dst`` in every layer's K and V cache with one launch.

        key_caches/value_caches: lists (one per layer) of C-contiguous caches of one shape and dtype;
        block_mapping int64 ``[n, 2]`` (src, dst) pairs, dst distinct and never a src of the same call: the
        pairs run concurrently, so the mapping is checked on the host first (``check_block_mapping``,
        ValueError).
        """
        if not key_caches:
            return
        host = block_mapping.get() if hasattr(block_mapping, "get") else block_mapping
        m = self._dev(check_block_mapping(host, key_caches[0].shape[0]), np.int64)
        if m.shape[0] == 0:
            return
        caches = list(key_caches) + list(value_caches)
        ref = caches[0]
        cache = _ctype(ref, "cache")
        for c in caches:
            if c.shape != ref.shape or c.dtype != ref.dtype or not c.flags.c_contiguous:
                raise ValueError("all KV caches must be C-contiguous with one shape and dtype")
        if len(key_caches) != len(value_caches):
            raise ValueError("key_caches and value_caches must have one entry per layer")
        block_bytes = int(np.prod(ref.shape[1:])) * ref.dtype.itemsize
        word = src.copy_word_bytes(block_bytes)
        kptr = self.xp.asarray(np.array([self._address(c) for c in key_caches], dtype=np.uint64))
        vptr = self.xp.asarray(np.array([self._address(c) for c in value_caches], dtype=np.uint64))
        # copy_blocks is dtype-free and in every module: use one that is already compiled if possible.
        compiled = getattr(self._launch, "_modules", {})
        act, cache = next((p for p in src.DTYPE_PAIRS if p[1] == cache and p in compiled), (cache, cache))
        self._kernel(
            act,
            cache,
            f"copy_blocks_kernel<{word}>",
            (m.shape[0], len(key_caches), 1),
            (256, 1, 1),
            (kptr, vptr, m, _i64(block_bytes // word)),
        )

    # ------------------------------------------------------------------ dense layers
    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm of ``x [num_tokens, hidden]`` (a new array); with ``residual``: ``residual += x`` in
        place first and the norm of the sum is returned. weight ``[hidden]`` in x's dtype or float32."""
        act = _ctype(x, "x")
        wt = _ctype(weight, "weight")
        if wt not in (act, src.F32):
            raise ValueError(f"weight dtype {weight.dtype} must be float32 or match x ({x.dtype})")
        if x.ndim != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden]; got {x.shape}, {weight.shape}")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
            raise ValueError("residual must match x in shape and dtype")
        num_tokens, hidden = x.shape
        out = self.xp.empty((num_tokens, hidden), dtype=x.dtype)
        if num_tokens == 0:
            return out
        weight = self.xp.ascontiguousarray(weight)
        res = residual if residual is not None else np.uint64(0)
        res_stride = _row_stride(residual, "residual", 1) if residual is not None else 0
        self._kernel(
            act,
            act,
            f"rms_norm_kernel<{act}, {wt}>",
            (num_tokens, 1, 1),
            (src.round_threads(hidden, 1024), 1, 1),
            (
                out,
                _i64(hidden),
                x,
                _i64(_row_stride(x, "x", 1)),
                res,
                _i64(res_stride),
                weight,
                np.float32(eps),
                _i32(hidden),
                _i32(residual is not None),
            ),
        )
        return out

    def rotary_embedding(self, positions, query, key, cos_sin_cache):
        """RoPE in place, HF rotate-half layout (see ``cpu.rotary_embedding``). positions int64
        ``[num_tokens]``; query ``[num_tokens, num_heads, head_dim]``, key ``[num_tokens, num_kv_heads,
        head_dim]`` (token strides free); cos_sin_cache float32 ``[max_position, head_dim]``."""
        act = _ctype(query, "query")
        _check_rope(query, key, cos_sin_cache)
        num_tokens, num_heads, head_dim = query.shape
        if num_tokens == 0:
            return
        pos = self._dev(positions, np.int64)
        cs = self.xp.ascontiguousarray(cos_sin_cache)
        num_kv_heads = key.shape[1]
        threads = src.round_threads((num_heads + num_kv_heads) * head_dim // 2, 512)
        self._kernel(
            act,
            act,
            f"rotary_embedding_kernel<{act}>",
            (num_tokens, 1, 1),
            (threads, 1, 1),
            (
                pos,
                query,
                _i64(_row_stride(query, "query", 2)),
                key,
                _i64(_row_stride(key, "key", 2)),
                cs,
                _i32(num_heads),
                _i32(num_kv_heads),
                _i32(head_dim),
            ),
        )

    def silu_and_mul(self, x):
        """SwiGLU: ``x [num_tokens, 2 * inter]`` -> ``silu(x[:, :inter]) * x[:, inter:]`` (a new array)."""
        act = _ctype(x, "x")
        x = self.xp.ascontiguousarray(x)
        num_tokens, two_inter = x.shape
        inter = two_inter // 2
        out = self.xp.empty((num_tokens, inter), dtype=x.dtype)
        n = num_tokens * inter
        if n == 0:
            return out
        threads = 256
        self._kernel(
            act,
            act,
            f"silu_and_mul_kernel<{act}>",
            (src.elementwise_blocks(n, threads, self.num_sms), 1, 1),
            (threads, 1, 1),
            (out, x, _i64(num_tokens), _i32(inter)),
        )
        return out

    def sample(self, logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
        """Token ids drawn on the device from rows of ``logits [num_rows, vocab]`` (see
        ``rawpaged.testing.reference_sampler.sample`` for the semantics; ``cuda/sampling.cu`` for the
        kernel). The per-sample arguments are host arrays ``[num_samples]``; two small packed uploads go
        in, int32 ids come back (4 bytes a sample).
        Returns int64 ``[num_samples]`` on the host.
        """
        act = _ctype(logits, "logits")
        num_rows, vocab = logits.shape
        n = len(sample_rows)
        rows = np.asarray(sample_rows, dtype=np.int64)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if rows.min() < 0 or rows.max() >= num_rows:
            raise ValueError(f"sample_rows must index the {num_rows} logits rows, got {rows.tolist()}")
        ints = np.stack([rows, np.asarray(top_k, dtype=np.int64)], axis=1).astype(np.int32)
        floats = np.stack([np.asarray(a, dtype=np.float32) for a in (temperature, top_p, min_p, uniforms)], axis=1)
        out = self.xp.empty(n, dtype=np.int32)
        # the tempered probabilities in shared memory when a row fits beside the kernel's static shared
        # memory (49152 floats: 192 KiB of the 227 KiB opt-in on Hopper), else in a global workspace
        name = f"sample_kernel<{act}>"
        static = getattr(self._launch, "static_smem_bytes", None)
        static = static(act, act, name) if static is not None else src.SAMPLE_STATIC_SMEM_BYTES
        smem = src.sample_smem_bytes(vocab, self.max_smem_optin, static)
        probs = np.uint64(0) if smem else self.xp.empty((n, vocab), dtype=np.float32)
        self._kernel(
            act,
            act,
            name,
            (n, 1, 1),
            (src.sample_threads(vocab), 1, 1),
            (
                out,
                logits,
                _i64(_row_stride(logits, "logits", 1)),
                self._dev(ints, np.int32),
                self._dev(floats, np.float32),
                probs,
                _i32(vocab),
                _i32(smem > 0),
            ),
            smem,
        )
        return self.to_numpy(out).astype(np.int64)

    def apply_token_bitmask(self, logits, bitmask, rows):
        """Structured outputs: the logits of the tokens a bitmask forbids set to ``-inf``, in place, on
        the device (see ``cpu.apply_token_bitmask`` for the layout; ``cuda/sampling.cu`` for the kernel).
        ``bitmask`` int32 ``[n, words]`` and ``rows`` ``[n]`` are host arrays (uploaded, 4 bytes a word).

        Raises:
            ValueError on shapes or dtypes that do not fit.
        """
        act = _ctype(logits, "logits")
        num_rows, vocab = logits.shape
        rows = np.asarray(rows, dtype=np.int64)
        bitmask = np.ascontiguousarray(bitmask)
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != rows.shape[0]:
            raise ValueError(f"bitmask must be int32 [{rows.shape[0]}, words], got {bitmask.dtype} {bitmask.shape}")
        if rows.size == 0:
            return
        if rows.min() < 0 or rows.max() >= num_rows:
            raise ValueError(f"rows must index the {num_rows} logits rows")
        threads = 256
        self._kernel(
            act,
            act,
            f"apply_token_bitmask_kernel<{act}>",
            (-(-vocab // threads), rows.shape[0], 1),
            (threads, 1, 1),
            (
                logits,
                _i64(_row_stride(logits, "logits", 1)),
                self._dev(bitmask, np.int32),
                _i32(bitmask.shape[1]),
                self._dev(rows, np.int32),
                _i32(vocab),
            ),
        )

    def default_kv_cache_memory(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV pool may take: ``gpu_memory_utilization`` of the device's total memory, minus what
        is in use (the weights), minus ``ACTIVATION_HEADROOM_BYTES`` for what the first steps allocate
        next to the pool (activations, logits, cuBLAS's workspace). Call after the weights are loaded.

        CuPy's pool first returns its cached free blocks to the driver: counting them as free would be
        wrong, since fragments of the wrong sizes cannot hold a pool of large caches."""
        self.xp.get_default_memory_pool().free_all_blocks()
        free, total = self.xp.cuda.runtime.memGetInfo()
        in_use = total - free
        return max(0, int(gpu_memory_utilization * total) - in_use - ACTIVATION_HEADROOM_BYTES)

    # ------------------------------------------------------------------ arrays, matmul, embedding
    def zeros(self, shape, dtype):
        """A zero-filled device array (KV caches); ``ml_dtypes.bfloat16`` gives ``uint16`` bf16 bits."""
        if np.dtype(dtype) == _BF16:
            dtype = np.uint16
        return self.xp.zeros(shape, dtype=dtype)

    def asarray(self, x, dtype=None):
        """Host (or device) array -> device array. ``ml_dtypes.bfloat16`` input or ``dtype`` gives a
        ``uint16`` array of bf16 bits."""
        if dtype is not None and np.dtype(dtype) == _BF16:
            host = x.get() if hasattr(x, "get") else np.asarray(x)
            if host.dtype == np.uint16:
                return self.xp.asarray(host)
            return self.xp.asarray(np.asarray(host, dtype=np.float32).astype(_BF16).view(np.uint16))
        if isinstance(x, np.ndarray) and x.dtype == _BF16:
            x = x.view(np.uint16)
        return self.xp.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        """Device array -> NumPy; ``uint16`` (bf16 bits) comes back as ``ml_dtypes.bfloat16``."""
        host = x.get() if hasattr(x, "get") else np.asarray(x)
        if host.dtype == np.uint16:
            return host.view(_BF16)
        return host

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, host, dtype: str):
        """A host tensor (e.g. a memory-mapped safetensors view; float32, float16 or bfloat16) -> a new
        contiguous device array of ``dtype`` ("float32", "float16", "bfloat16" = uint16 bits). The bytes
        go through the pinned staging buffers in the checkpoint's dtype and are converted on the device
        (``convert_kernel``), so no host copy of the model is made. A ``QuantizedTensor`` (an embedding
        table) stays in its blocks: a :class:`DeviceQuantized`."""
        if isinstance(host, QuantizedTensor):
            return self._upload_quantized(host, dtype)
        out = self.xp.empty(host.shape, dtype=float_type(dtype).device)
        self._upload_into(out, host, dtype)
        return out

    def load_linear(self, parts: list, dtype: str):
        """HF ``[out_i, in]`` host weights -> one device weight ``[sum out_i, in]`` of ``dtype`` (fused
        projections such as QKV or gate/up are uploaded part by part into their rows). ``QuantizedTensor``
        parts of one format stay in their blocks (rows concatenated, a :class:`DeviceQuantized`); mixed
        formats are dequantized."""
        if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
            return self._upload_quantized(QuantizedTensor.concat(parts), dtype)
        parts = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
        storage = float_type(dtype).device
        cols = parts[0].shape[1]
        if any(p.ndim != 2 or p.shape[1] != cols for p in parts):
            raise ValueError(f"fused linear parts must be 2-D with equal input size, got {[p.shape for p in parts]}")
        out = self.xp.empty((sum(p.shape[0] for p in parts), cols), dtype=storage)
        row = 0
        for p in parts:
            self._upload_into(out[row : row + p.shape[0]], p, dtype)
            row += p.shape[0]
        return out

    def _upload_quantized(self, q: QuantizedTensor, dtype: str) -> DeviceQuantized:
        planes = []
        for host in (q.qs, q.scales) + ((q.mins,) if q.mins is not None else ()):
            dev = self.xp.empty(host.shape, dtype=host.dtype)
            self._copy_to_device(dev, np.ascontiguousarray(host))
            planes.append(dev)
        mins = planes[2] if len(planes) == 3 else planes[1]
        return DeviceQuantized(q.qtype, tuple(q.shape), planes[0], planes[1], mins, np.dtype(float_type(dtype).device))

    def finish_loading(self) -> None:
        """Wait for the weight uploads and free the pinned staging buffers."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _upload_into(self, dst, host, dtype: str) -> None:
        host = np.asarray(host)
        host_type = float_type_of(host.dtype)
        if host_type is None:  # float64 or integer checkpoints: narrow on the host
            host, host_type = np.asarray(host, dtype=np.float32), FLOAT32
        if host_type.name == dtype:
            self._copy_to_device(dst, host)
            return
        raw = self.xp.empty(host.shape, dtype=host_type.device)
        self._copy_to_device(raw, host)
        self.convert(dst, raw)

    def convert(self, out, x) -> None:
        """``out[...] = x`` between float32, float16 and bfloat16 (uint16 bits) device arrays of equal
        size, both contiguous; through float32, rounding to nearest even."""
        d, s = _ctype(out, "out"), _ctype(x, "x")
        if out.size != x.size or not (out.flags.c_contiguous and x.flags.c_contiguous):
            raise ValueError(f"convert needs equal-size contiguous arrays, got {out.shape} and {x.shape}")
        if out.size == 0:
            return
        if d == s:
            out[...] = x.reshape(out.shape)
            return
        threads = 256
        self._kernel(
            d,
            d,
            f"convert_kernel<{d}, {s}>",
            (src.elementwise_blocks(out.size, threads, self.num_sms), 1, 1),
            (threads, 1, 1),
            (out, x, _i64(out.size)),
        )

    def _staged_copy(self, dst, host) -> None:
        if self._stager is None:
            self._stager = PinnedStager(self.xp)
        self._stager.copy(dst, host)

    def linear(self, x, weight, bias=None, float32_out=False):
        """``x @ weight.T (+ bias)``; x ``[n, in]``, weight ``[out, in]`` (HF layout), same dtype.

        float32/float16: CuPy matmul (cuBLAS). bfloat16 (uint16 bits): ``cublasGemmEx`` with
        CUDA_R_16BF A/B/C and CUBLAS_COMPUTE_32F (float32 accumulation, one rounding to bf16 at the end;
        a bias is preloaded into C and added in the float32 epilogue with beta = 1).

        ``float32_out`` (the LM head): the float32 accumulator is written as it is, with a CUDA_R_32F C
        (bfloat16 and float16 inputs through gemmEx; no bias then), so logits keep float32's resolution;
        a quantized weight's product is converted after its kernel.

        Raises:
            ValueError: mismatched dtypes or shapes, or a bias with ``float32_out`` on 16-bit inputs.
        """
        if x.dtype != weight.dtype:
            raise ValueError(f"x {x.dtype} and weight {weight.dtype} must have the same dtype")
        if isinstance(weight, DeviceQuantized):
            y = self._quant_linear(x, weight, bias)
            if not float32_out or y.dtype == np.float32:
                return y
            out = self.xp.empty(y.shape, dtype=np.float32)
            self.convert(out, y)
            return out
        if self._capture_blas is not None:  # CuPy's matmul cannot be captured
            if float32_out and bias is not None and x.dtype != np.float32:
                raise ValueError("a bias with float32_out needs float32 inputs (an LM head has no bias)")
            in_type = {np.dtype(np.float32): _CUDA_R_32F, np.dtype(np.float16): _CUDA_R_16F}.get(x.dtype, _CUDA_R_16BF)
            return self._gemm_ex(x, weight, bias, in_type, float32_out)
        if x.dtype == np.float32 or (x.dtype == np.float16 and not float32_out):
            y = x @ weight.T
            if bias is not None:
                y += bias
            return y
        if float32_out and bias is not None:
            raise ValueError("a bias with float32_out needs float32 inputs (an LM head has no bias)")
        if x.dtype == np.float16:
            return self._gemm_ex(x, weight, None, _CUDA_R_16F, float32_out=True)
        return self._linear_bf16(x, weight, bias, float32_out)

    def _linear_bf16(self, x, weight, bias, float32_out=False):
        return self._gemm_ex(x, weight, bias, _CUDA_R_16BF, float32_out)

    def _gemm_ex(self, x, weight, bias, in_type, float32_out):
        """``cublasGemmEx`` of ``x`` and ``weight`` (``in_type``: CUDA_R_16BF, CUDA_R_16F or, while a graph
        captures, CUDA_R_32F) with float32 accumulation, written in the inputs' type or, with
        ``float32_out``, in float32. Through CuPy's handle, or through :attr:`_capture_blas` (a
        :class:`~rawpaged.kernels.cublas.CublasHandle` bound to the capturing stream) while one is set."""
        xp = self.xp
        x = xp.ascontiguousarray(x)
        weight = xp.ascontiguousarray(weight)
        n, k = x.shape
        m = weight.shape[0]
        if weight.shape[1] != k:
            raise ValueError(f"x {x.shape} and weight {weight.shape} do not chain")
        y = xp.empty((n, m), dtype=np.float32 if float32_out else x.dtype)
        out_type = _CUDA_R_32F if float32_out else in_type
        beta_v = 0.0
        if bias is not None:
            y[...] = bias  # plain copy of the bias bits, broadcast over rows
            beta_v = 1.0
        if n == 0 or m == 0:
            return y
        # host scalars: cuBLAS reads them when the call is made (or captured)
        alpha = np.array(1.0, dtype=np.float32)
        beta = np.array(beta_v, dtype=np.float32)
        if self._capture_blas is not None:
            gemm_ex = self._capture_blas.gemm_ex
        else:
            try:  # deferred: CuPy, an optional library
                from cupy_backends.cuda.libs import cublas as cupy_cublas
            except ImportError:  # deferred: older CuPy keeps cuBLAS here
                from cupy.cuda import cublas as cupy_cublas
            handle = xp.cuda.device.get_cublas_handle()

            def gemm_ex(*args):
                cupy_cublas.gemmEx(handle, *args, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

        address = self._address
        cublas.gemm_nt(
            gemm_ex,
            address(x),
            address(weight),
            address(y),
            n,
            m,
            k,
            in_type,
            out_type,
            alpha.ctypes.data,
            beta.ctypes.data,
        )
        return y

    def _quant_linear(self, x, w: DeviceQuantized, bias):
        """``x [M, K] @ dequantize(w).T (+ bias)`` on the blocks: ``quant_gemv_kernel`` for M up to
        ``QUANT_GEMV_MAX_M`` (decode), ``quant_gemm_kernel`` tiles above."""
        act = _ctype(x, "x")
        if x.ndim != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"x {x.shape} and the {w.qtype} weight {w.shape} do not chain")
        M, K = x.shape
        N = w.shape[0]
        out = self.xp.empty((M, N), dtype=x.dtype)
        if M == 0 or N == 0:
            return out
        x_stride = _row_stride(x, "x", 1)
        has_bias = bias is not None
        if has_bias and (bias.dtype != x.dtype or bias.shape != (N,)):
            raise ValueError(f"bias {bias.shape} {bias.dtype} must be [{N}] of {x.dtype}")
        fmt = src.QUANT_FORMATS[w.qtype]
        args = (out, x, _i64(x_stride), w.qs, w.scales, w.mins, bias if has_bias else out, _i32(has_bias))
        args += (_i32(M), _i32(N), _i32(K))
        if M <= src.QUANT_GEMV_MAX_M:
            threads = 128
            grid = (-(-N // (threads // 32)), 1, 1)
            self._kernel(act, act, f"quant_gemv_kernel<{act}, {fmt}>", grid, (threads, 1, 1), args)
        else:
            grid = (-(-N // src.QG_BN), -(-M // src.QG_BM), 1)
            self._kernel(act, act, f"quant_gemm_kernel<{act}, {fmt}>", grid, (src.QG_THREADS, 1, 1), args)
        return out

    def embedding(self, token_ids, table):
        """Rows of ``table [vocab, hidden]`` for ``token_ids [n]``, in the table's dtype (a
        :class:`DeviceQuantized` table's rows are dequantized on lookup, into its activation dtype)."""
        ids = self._dev(token_ids, np.int64)
        if not isinstance(table, DeviceQuantized):
            return self.xp.take(table, ids, axis=0)
        act = _CTYPES[table.dtype]
        out = self.xp.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
        if ids.shape[0]:
            self._kernel(
                act,
                act,
                f"quant_embedding_kernel<{act}, {src.QUANT_FORMATS[table.qtype]}>",
                (ids.shape[0], 1, 1),
                (128, 1, 1),
                (out, ids, table.qs, table.scales, table.mins, _i32(table.shape[1])),
            )
        return out
