"""rawpaged: LLM inference with a paged KV cache, no PyTorch."""

from rawpaged.engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from rawpaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
