"""Weights onto the device: float tensors in the checkpoint's dtype through pinned staging buffers, converted
to the model's dtype on the device (no host copy of the model); GGUF block-quantized tensors stay in their
blocks (:class:`DeviceQuantized`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rawpaged.dtypes import FLOAT32, float_type, float_type_of
from rawpaged.kernels.cuda.elementwise import convert
from rawpaged.kernels.cuda.launch import MEMCPY_HOST_TO_DEVICE
from rawpaged.kernels.quantization import QuantizedTensor, runs_of_one_format


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


@dataclass(frozen=True)
class DeviceStacked:
    """Quantized parts of different formats stacked along their rows (a fused projection of a K-quant mix,
    e.g. Q4_K query and key rows beside Q6_K value rows): each a :class:`DeviceQuantized`, computed part by
    part into its columns of the output."""

    parts: tuple
    shape: tuple
    dtype: np.dtype

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


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
            cuda.runtime.memcpyAsync(dst.data.ptr + off, staging.ctypes.data, n, MEMCPY_HOST_TO_DEVICE, stream.ptr)
            self._events[i] = stream.record()
        self.bytes_copied += src.nbytes

    def close(self) -> None:
        """Wait for the copies in flight and release the pinned buffers."""
        for e in self._events:
            if e is not None:
                e.synchronize()
        self._events = [None, None]
        self._buffers = []


class StagedCopy:
    """``KernelContext.copy_to_device`` on a GPU: host -> device through a :class:`PinnedStager` made on the
    first copy; :meth:`close` (when the weights are loaded) waits for the copies and frees its buffers."""

    def __init__(self, cupy):
        self._cupy = cupy
        self._stager = None

    def __call__(self, dst, host) -> None:
        if self._stager is None:
            self._stager = PinnedStager(self._cupy)
        self._stager.copy(dst, host)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def load_weight(ctx, host, dtype: str):
    """A host tensor (e.g. a memory-mapped safetensors view; float32, float16 or bfloat16) -> a new
    contiguous device array of ``dtype`` ("float32", "float16", "bfloat16" = uint16 bits). The bytes
    go through the pinned staging buffers in the checkpoint's dtype and are converted on the device
    (``convert_kernel``), so no host copy of the model is made. A ``QuantizedTensor`` (an embedding
    table) stays in its blocks: a :class:`DeviceQuantized`."""
    if isinstance(host, QuantizedTensor):
        return upload_quantized(ctx, host, dtype)
    out = ctx.xp.empty(host.shape, dtype=float_type(dtype).device)
    upload_into(ctx, out, host, dtype)
    return out


def load_linear(ctx, parts: list, dtype: str):
    """HF ``[out_i, in]`` host weights -> one device weight ``[sum out_i, in]`` of ``dtype`` (fused
    projections such as QKV or gate/up are uploaded part by part into their rows). ``QuantizedTensor``
    parts of one format stay in their blocks (rows concatenated, a :class:`DeviceQuantized`), parts of
    different formats too (adjacent ones of a format concatenated, a :class:`DeviceStacked`); quantized
    parts beside float ones are dequantized."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        packed = tuple(upload_quantized(ctx, QuantizedTensor.concat(run), dtype) for run in runs_of_one_format(parts))
        if len(packed) == 1:
            return packed[0]
        return DeviceStacked(packed, (sum(p.shape[0] for p in packed), parts[0].shape[1]), packed[0].dtype)
    parts = [p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts]
    storage = float_type(dtype).device
    cols = parts[0].shape[1]
    if any(p.ndim != 2 or p.shape[1] != cols for p in parts):
        raise ValueError(f"fused linear parts must be 2-D with equal input size, got {[p.shape for p in parts]}")
    out = ctx.xp.empty((sum(p.shape[0] for p in parts), cols), dtype=storage)
    row = 0
    for p in parts:
        upload_into(ctx, out[row : row + p.shape[0]], p, dtype)
        row += p.shape[0]
    return out


def upload_quantized(ctx, q: QuantizedTensor, dtype: str) -> DeviceQuantized:
    """The planes on the device; a sub-block format's one plane is its GGUF bytes (a one-element
    ``scales`` stands in for the planes its kernels never read)."""
    scales = q.scales if q.scales is not None else np.zeros(1, np.uint16)
    planes = []
    for host in (q.qs, scales) + ((q.mins,) if q.mins is not None else ()):
        dev = ctx.xp.empty(host.shape, dtype=host.dtype)
        ctx.copy_to_device(dev, np.ascontiguousarray(host))
        planes.append(dev)
    mins = planes[2] if len(planes) == 3 else planes[1]
    return DeviceQuantized(q.qtype, tuple(q.shape), planes[0], planes[1], mins, np.dtype(float_type(dtype).device))


def upload_into(ctx, dst, host, dtype: str) -> None:
    host = np.asarray(host)
    host_type = float_type_of(host.dtype)
    if host_type is None:  # float64 or integer checkpoints: narrow on the host
        host, host_type = np.asarray(host, dtype=np.float32), FLOAT32
    if host_type.name == dtype:
        ctx.copy_to_device(dst, host)
        return
    raw = ctx.xp.empty(host.shape, dtype=host_type.device)
    ctx.copy_to_device(raw, host)
    convert(ctx, dst, raw)
