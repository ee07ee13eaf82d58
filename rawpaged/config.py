"""Engine configuration (names as in vLLM's engine arguments)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
#: (activation dtype, KV-cache dtype) pairs each backend runs (CUDA: cuda_sources.DTYPE_PAIRS).
DTYPE_PAIRS = {
    "cpu": (("float32", "float32"), ("float32", "bfloat16")),
    "cuda": (("float32", "float32"), ("float32", "bfloat16"), ("float32", "float16"), ("float16", "float16"),
             ("bfloat16", "bfloat16")),
}


@dataclass
class EngineConfig:
    """Attributes:
        model: None (the default SmolLM2-135M-Instruct, prepared on first use), its name, or a path to an
            HF-style directory.
        device: "auto" (cuda if a GPU is usable, else cpu), "cpu" or "cuda".
        dtype: compute dtype of weights and activations: "auto", "float32", "float16" or "bfloat16".
            "auto" is float32 on the CPU (its only dtype) and, on CUDA, the checkpoint's ``torch_dtype``
            when it is float16/bfloat16, else bfloat16 (vLLM picks float16 for float32 checkpoints;
            bfloat16 keeps float32's exponent range).
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size in blocks; None sizes it from ``kv_cache_memory``.
        kv_cache_memory: KV pool size in bytes when ``num_kv_blocks`` is None (CPU default 1 GiB;
            CUDA: what ``gpu_memory_utilization`` of the device's memory leaves after the weights).
        gpu_memory_utilization: fraction of the GPU's total memory the engine may use (weights + KV pool).
        kv_cache_dtype: "auto" (= dtype), "float32", "float16" or "bfloat16"; see :data:`DTYPE_PAIRS`.
        max_num_seqs: sequences per step at most.
        max_model_len: prompt + generated tokens at most per sequence (None: the model's context).
        max_num_batched_tokens: token budget per step (prefill chunks + decodes).
        enable_prefix_caching: reuse full KV blocks of identical prefixes across requests.
        enable_block_sharing: forks (n > 1, beams) share blocks copy-on-write; False makes them copy
            every block instead (a baseline for measuring what sharing saves).
        seed: seed of the engine's generator for requests without their own seed.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_block_sharing: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


def resolve_dtypes(dtype: str, kv_cache_dtype: str, backend: str, checkpoint_dtype: str | None) -> tuple:
    """The (activation, KV-cache) dtype names the engine runs with; "auto" resolved as documented on
    :class:`EngineConfig`. Raises ValueError naming ``dtype``/``kv_cache_dtype`` for a pair ``backend``
    does not run."""
    if dtype == "auto":
        if backend == "cpu":
            dtype = "float32"
        else:
            dtype = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
    if kv_cache_dtype == "auto":
        kv_cache_dtype = dtype if (dtype, dtype) in DTYPE_PAIRS[backend] else "float32"
    if (dtype, kv_cache_dtype) not in DTYPE_PAIRS[backend]:
        if all(a != dtype for a, _ in DTYPE_PAIRS[backend]):
            raise ValueError(f"dtype {dtype!r} is not supported on the {backend} backend "
                             f"(supported: {sorted({a for a, _ in DTYPE_PAIRS[backend]})})")
        pairs = ", ".join(f"{a}/{c}" for a, c in DTYPE_PAIRS[backend])
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} with dtype {dtype!r} is not supported on the {backend} "
                         f"backend (supported dtype/kv_cache_dtype: {pairs})")
    return dtype, kv_cache_dtype
