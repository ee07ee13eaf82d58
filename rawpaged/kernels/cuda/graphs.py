"""CUDA graphs for the backend: ``GraphCapture`` records the kernels a function launches and replays
them (``--no-enforce-eager``; ``model_executor.cuda_graph`` decides what is captured)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cuda import cublas


class GraphCapture:
    """The stream, memory pool and cuBLAS handle every graph of one backend is captured with, made on the
    first capture and shared by all (graphs never run concurrently).

    Args:
        ctx: the backend's ``launch.KernelContext``; its ``capture_blas`` is set while a capture runs.
    """

    def __init__(self, ctx):
        self._ctx = ctx
        self._state = None

    def _stream_pool_handle(self):
        if self._state is None:
            xp = self._ctx.xp
            xp.cuda.device.get_cublas_handle()  # CuPy loads libcublas; load_library finds it in the process
            stream = xp.cuda.Stream(non_blocking=True)
            pool = xp.cuda.MemoryPool()
            workspace = xp.empty(cublas.WORKSPACE_BYTES, dtype=np.uint8)
            address = self._ctx.address(workspace)
            handle = cublas.CublasHandle(cublas.load_library(), stream.ptr, address, workspace.nbytes)
            self._state = (stream, pool, workspace, handle)
        stream, pool, _, handle = self._state
        return stream, pool, handle

    def capture(self, fn):
        """Record the kernels ``fn()`` launches as a CUDA graph; returns ``(replay, output)``:
        ``replay()`` relaunches them all on the current stream, ``output`` is what ``fn`` returned
        (device arrays the replays write again).

        ``fn`` runs twice on a private, non-default stream: once eagerly (compiles kernels, picks
        cuBLAS's algorithms, fills the graphs' memory pool) and once under capture (relaxed mode).
        Arrays ``fn`` allocates come from one memory pool kept for the graphs alone: what a graph's
        kernels read and write stays reserved for it, and graphs share those buffers. Products go through
        a cuBLAS handle bound to that stream (:mod:`rawpaged.kernels.cuda.cublas`). Everything ``fn``
        reads must stay at the addresses it read them from (static input buffers), and ``fn`` must not
        synchronize with the host.

        Raises whatever capture raises (the capture is ended and the handle dropped first).
        """
        xp = self._ctx.xp
        stream, pool, handle = self._stream_pool_handle()
        xp.cuda.get_current_stream().synchronize()  # the inputs' uploads, on the current stream
        self._ctx.capture_blas = handle
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
            self._ctx.capture_blas = None

        def replay():
            graph.launch(stream=xp.cuda.get_current_stream())

        return replay, output
