"""Kernel backends. ``cpu`` (Numba/NumPy) is always available; ``cuda`` (CuPy RawModule) needs a GPU.

Both expose the same functions with the same semantics: ``reshape_and_cache``, ``paged_attention``,
``prefill_attention``, ``copy_blocks``, ``rms_norm``, ``rotary_embedding``, ``silu_and_mul``.
"""
