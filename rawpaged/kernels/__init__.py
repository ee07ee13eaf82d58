"""Kernel backends. ``cpu`` (Numba/NumPy) is always available; ``cuda`` (CuPy RawModule) needs a GPU.

Both implement the whole ``Backend`` contract of ``rawpaged.kernels.backend`` with the same names and
semantics (``reshape_and_cache``, ``paged_attention``, ``prefill_attention``, ``copy_blocks``, ``rms_norm``,
``rotary_embedding``, ``silu_and_mul``, ``sample``, arrays and weight loading).
"""


def get_backend(device: str = "auto"):
    """The backend for ``device``: "cpu", "cuda", or "auto" (cuda when a GPU is usable, else cpu).

    Raises:
        RuntimeError: ``device="cuda"`` and CuPy or a CUDA device is missing (one-line message).
        ValueError: unknown device name.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device in ("auto", "cuda"):
        try:
            from rawpaged.kernels.cuda.backend import CudaBackend  # deferred: CuPy, an optional library

            return CudaBackend()
        except (ImportError, RuntimeError) as e:
            if device == "cuda":
                raise RuntimeError(
                    f"device 'cuda' unavailable: {e} (a CUDA host needs pip install -e '.[cuda12]' or '.[cuda13]')"
                ) from None
    from rawpaged.kernels.cpu.backend import CPUBackend  # deferred: Numba, after numba_target.configure has run

    return CPUBackend()
