"""rawpaged: LLM inference with a paged KV cache, no PyTorch."""

from rawpaged.kernels.cpu.numba_target import configure as _configure_numba
from rawpaged.kernels.cpu.openblas_env import configure as _configure_openblas

_configure_openblas()  # before anything imports numpy: idle OpenBLAS threads sleep after ~25 us
_configure_numba()  # before anything imports numba: 512-bit vectors on AVX-512 hosts


from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.engine.outputs import CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from rawpaged.entrypoints.llm import LLM
from rawpaged.lora.request import LoRARequest
from rawpaged.pooling_params import PoolingParams
from rawpaged.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "PoolingRequestOutput",
]
__version__ = "0.1.0"
