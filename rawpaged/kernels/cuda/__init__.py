"""The CUDA backend (CuPy RawModules over ``cuda/*.cu``): ``backend.CudaBackend`` over one module per kind
of kernel. ``program`` and ``launch_config`` need neither a GPU nor CuPy (the compile test and the CPU
emulation use them); nothing here imports CuPy until a ``CudaBackend`` is created."""
