"""The CPU backend (NumPy + Numba): ``backend.CPUBackend`` over one module per kind of kernel.

Kept free of imports: ``import rawpaged`` runs ``numba_target`` and ``openblas_env`` from here before
Numba and NumPy are loaded.
"""
