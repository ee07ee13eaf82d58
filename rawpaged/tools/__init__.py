"""Command-line tools built on the library: ``python -m rawpaged.tools.check_cuda_engine`` (the engine's
CUDA-vs-CPU check that ``scripts/gpu_check.sh`` runs on a device)."""
