"""The CUDA backend: ``CudaBackend``, the ``Backend`` contract (``rawpaged.kernels.backend``) over the
kernels of ``cuda/*.cu`` through ``cupy.RawModule`` and the products through cuBLAS.

Same names and semantics as :class:`rawpaged.kernels.cpu.backend.CPUBackend` (see the CPU modules for the
math and its sources); the kernels themselves are documented in ``cuda/attention.cu``, ``cuda/cache.cu``,
``cuda/layers.cu``, ``cuda/sampling.cu``, ``cuda/logprobs.cu``, ``cuda/quant.cu`` and ``cuda/moe.cu``.
Differences, all additive:

* dtypes: activations (query/out/x/...) may be float32, float16 or bfloat16, KV caches float32, float16
  or bfloat16, in the combinations of :data:`program.DTYPE_PAIRS`. CuPy has no bfloat16, so a
  bfloat16 tensor is a CuPy ``uint16`` array holding the bit patterns (:meth:`asarray` converts
  ``ml_dtypes.bfloat16`` host arrays, :meth:`to_numpy` converts back). Math is float32 throughout.
* ``paged_attention(..., max_context_len=None)`` and ``prefill_attention(..., max_query_len=None)``: upper
  bounds known on the host that size the launch (``attention``).
* ``linear``: float32/float16 through CuPy's matmul (cuBLAS); bfloat16 (``uint16`` storage) through
  ``cublasGemmEx`` with float32 accumulation (``linear``).
* ``embedding`` returns rows in the table's dtype (float32 tables give float32, as on the CPU).
* GGUF weights stay in their blocks (``weights.DeviceQuantized``), mixture-of-experts stacks too
  (``moe.DeviceQuantizedExperts``); the MoE ops take and give activations of any of the three dtypes.

The backend is a thin front: each method calls the function of the same name in ``cache``, ``attention``,
``elementwise``, ``sampling``, ``logprobs``, ``linear``, ``weights`` or ``moe`` with the backend's
``launch.KernelContext``.
Only this package imports CuPy, and only when a :class:`CudaBackend` is created: a CPU-only install never
imports it.
"""

from __future__ import annotations

import functools

import numpy as np

from rawpaged.dtypes import BFLOAT16
from rawpaged.kernels.cuda import attention, cache, elementwise, logprobs, moe, program, sampling, weights
from rawpaged.kernels.cuda import linear as products
from rawpaged.kernels.cuda.graphs import GraphCapture
from rawpaged.kernels.cuda.launch import DEFAULT_SMEM, CupyLauncher, KernelContext, host_byte_copy
from rawpaged.kernels.kv_cache import allocate_kv_cache

#: device memory kept out of the KV pool for what a step allocates beside it: activations (for the default
#: model at 2048 batched tokens, tens of MB), sampled rows' float32 logits, cuBLAS's workspace
ACTIVATION_HEADROOM_BYTES = 1 << 30
_BF16 = BFLOAT16.numpy


def _open_device(device: int | None):
    """CuPy and the CUDA device to use. Raises RuntimeError ("no CUDA device found: ...") when CuPy is
    missing or sees no usable GPU."""
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
    return cupy, dev


def _forward(module, name: str):
    """A method that calls ``module.name(self.ctx, ...)``, with that function's name, docstring and
    signature (its ``ctx`` standing for ``self``)."""
    fn = getattr(module, name)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return fn(self.ctx, *args, **kwargs)

    return method


class _ContextField:
    """An attribute of the backend's ``KernelContext``, read and set through the backend."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj.ctx, self.name)

    def __set__(self, obj, value):
        setattr(obj.ctx, self.name, value)


class CudaBackend:
    """The CUDA kernels behind the backend interface the model calls (same names as ``CPUBackend``).

    Args:
        device: CUDA device ordinal (default: CuPy's current device).
    Raises:
        RuntimeError: ``"no CUDA device found: ..."`` when CuPy is missing or sees no usable GPU.
    """

    name = "cuda"
    dtype_pairs = program.DTYPE_NAME_PAIRS

    def __init__(self, device: int | None = None):
        cupy, dev = _open_device(device)
        attrs = dev.attributes
        launcher = CupyLauncher(cupy)
        self.device = dev
        self.ctx = KernelContext(
            xp=cupy,
            launch=launcher,
            address=launcher.address,
            num_sms=int(attrs["MultiProcessorCount"]),
            max_smem_optin=int(attrs.get("MaxSharedMemoryPerBlockOptin", DEFAULT_SMEM)),
            copy_to_device=weights.StagedCopy(cupy),
        )
        self._graphs = GraphCapture(self.ctx)

    @classmethod
    def _with_launcher(cls, xp, launch, address, num_sms: int, max_smem_optin: int = 227 * 1024, copy_to_device=None):
        """A backend over another array module and kernel launcher (the CPU emulation tests use NumPy and
        the g++-built kernels). ``launch(act, cache, name, grid, block, args, smem_bytes)``;
        ``copy_to_device(dst, host)`` moves a host array's bytes into a device array (default: a byte copy
        for array modules whose arrays live on the host)."""
        self = cls.__new__(cls)
        self.device = None
        self.ctx = KernelContext(xp, launch, address, num_sms, max_smem_optin, copy_to_device or host_byte_copy)
        self._graphs = GraphCapture(self.ctx)
        return self

    #: the array module (CuPy), the device's streaming multiprocessors, its shared memory per block (bytes)
    xp = _ContextField()
    num_sms = _ContextField()
    max_smem_optin = _ContextField()

    @staticmethod
    def auto_dtype(checkpoint_dtype: str | None) -> str:
        """The checkpoint's float16/bfloat16, else bfloat16 (vLLM picks float16 for float32 checkpoints;
        bfloat16 keeps float32's exponent range)."""
        return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"

    # ------------------------------------------------------------------ kernels
    reshape_and_cache = _forward(cache, "reshape_and_cache")
    rotary_embedding_and_cache = _forward(cache, "rotary_embedding_and_cache")
    copy_blocks = _forward(cache, "copy_blocks")
    paged_attention = _forward(attention, "paged_attention")
    prefill_attention = _forward(attention, "prefill_attention")
    rms_norm = _forward(elementwise, "rms_norm")
    rotary_embedding = _forward(elementwise, "rotary_embedding")
    silu_and_mul = _forward(elementwise, "silu_and_mul")
    gelu_tanh_and_mul = _forward(elementwise, "gelu_tanh_and_mul")
    convert = _forward(elementwise, "convert")
    sample = _forward(sampling, "sample")
    apply_token_bitmask = _forward(sampling, "apply_token_bitmask")
    apply_logits_edits = _forward(sampling, "apply_logits_edits")
    logprob_rows = _forward(logprobs, "logprob_rows")
    linear = _forward(products, "linear")
    embedding = _forward(products, "embedding")
    load_weight = _forward(weights, "load_weight")
    load_linear = _forward(weights, "load_linear")

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether :meth:`capture_graph` can record launches (a real device; not the CPU emulation)."""
        return self.device is not None

    def capture_graph(self, fn):
        """``graphs.GraphCapture.capture``: record ``fn``'s launches; returns ``(replay, output)``.

        Raises RuntimeError without a device (the emulation records no graph) or when capture fails."""
        if not self.supports_cuda_graphs:
            raise RuntimeError("CUDA graphs need a GPU: this backend emulates its kernels")
        return self._graphs.capture(fn)

    # ------------------------------------------------------------------ arrays and memory
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
        self.ctx.copy_to_device(dst, host)

    #: the mixture-of-experts ops (``moe``: cuda/moe.cu and the grouped products of cuda/quant.cu)
    load_experts = _forward(moe, "load_experts")
    moe_route = _forward(moe, "moe_route")
    moe_align = _forward(moe, "moe_align")
    grouped_linear = _forward(moe, "grouped_linear")
    moe_combine = _forward(moe, "moe_combine")

    def finish_loading(self) -> None:
        """Wait for the weight uploads and free the pinned staging buffers."""
        close = getattr(self.ctx.copy_to_device, "close", None)
        if close is not None:
            close()

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

    def zeros(self, shape, dtype):
        """A zero-filled device array (KV caches); ``ml_dtypes.bfloat16`` gives ``uint16`` bf16 bits."""
        if np.dtype(dtype) == _BF16:
            dtype = np.uint16
        return self.xp.zeros(shape, dtype=dtype)

    def host_empty(self, shape, dtype):
        """A NumPy array in page-locked host memory (the driver copies it to and from the device
        asynchronously): the second KV tier's slots. Pageable memory in the CPU emulation."""
        dtype = np.dtype(dtype)
        if self.device is None:
            return np.empty(shape, dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer(
            self.xp.cuda.alloc_pinned_memory(max(n, 1)), dtype=dtype, count=n // dtype.itemsize
        ).reshape(shape)

    def allocate_kv_cache(self, shape, kv_cache_dtype: str):
        """A zeroed device cache of ``kv_cache_dtype`` (``kv_cache.allocate_kv_cache``)."""
        return allocate_kv_cache(self.zeros, shape, kv_cache_dtype)

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

    @staticmethod
    def to_numpy(x):
        """Device array -> NumPy; ``uint16`` (bf16 bits) comes back as ``ml_dtypes.bfloat16``."""
        host = x.get() if hasattr(x, "get") else np.asarray(x)
        if host.dtype == np.uint16:
            return host.view(_BF16)
        return host
