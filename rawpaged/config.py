"""Engine configuration (names as in vLLM's engine arguments). Each field's docstring is also its
``--help`` text: the command line is built from these fields (``rawpaged.entrypoints.cli``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Literal

from rawpaged.dtypes import DTYPE_CHOICES, KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPE_CHOICES
from rawpaged.pooling_params import PoolerConfig

Device = Literal["auto", "cpu", "cuda"]
DType = Literal[DTYPE_CHOICES]
KVCacheDType = Literal[KV_CACHE_DTYPE_CHOICES]
Quantization = Literal["gguf", "q8_0"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
PreemptionMode = Literal["swap", "recompute"]
SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``): each decoding sequence gets up to
    ``num_speculative_tokens`` draft tokens per step from a proposer, and the target model checks them
    all in one step (``rawpaged.spec_decode``).

    Raises ValueError naming the field for an unknown method or key, or a bad value."""

    method: SpeculativeMethod = "ngram"
    """ngram: prompt lookup, the tokens that followed the longest earlier match of the sequence's last
    ``prompt_lookup_min..prompt_lookup_max`` tokens (in the prompt or the output so far); suffix:
    SuffixDecoding, the most frequent continuation of the longest matched suffix in the sequence and in
    recent requests' outputs, as long as the match earns; draft_model: the greedy tokens of a smaller model
    (``model``) that shares the target's tokenizer"""
    model: str | None = None
    """draft_model: the draft model, as ``--model`` takes one (a directory, a .gguf file or the default
    model's name); given without ``method``, the method is draft_model"""
    num_speculative_tokens: int = 3
    """draft tokens per sequence per step at most (k); a step verifies k + 1 positions (on the CPU, k + 1 = 4
    rows fill one tile of the small-batch product: more cost a second pass over each weight tile)"""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix matched"""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix matched (longer matches are tried first)"""
    suffix_decoding_max_tree_depth: int = 32
    """suffix: the longest suffix matched"""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: draft tokens per matched token at most"""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a draft stops at a token less frequent than this among the matching occurrences"""
    suffix_decoding_max_cached_requests: int = 100
    """suffix: finished requests whose outputs are searched (0: only the sequence's own tokens)"""
    disable_by_batch_size: int | None = 8
    """no drafts in a step whose running batch has at least this many sequences (vLLM's name; none: always):
    at large batches a step is no longer bound by reading the weights, so verifying drafts costs more than
    it saves (measured: batch 32 of open-ended chats ran 13% slower with drafts)"""

    def __post_init__(self):
        if self.method not in SpeculativeMethod.__args__:
            raise ValueError(
                f"speculative_config.method must be one of {SpeculativeMethod.__args__}, got {self.method!r}"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "suffix_decoding_max_tree_depth",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.suffix_decoding_max_spec_factor, (int, float)) or not (
            self.suffix_decoding_max_spec_factor > 0
        ):
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) or not (
            0 <= self.suffix_decoding_min_token_prob <= 1
        ):
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")
        if (
            not isinstance(self.suffix_decoding_max_cached_requests, int)
            or self.suffix_decoding_max_cached_requests < 0
        ):
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0")
        if self.disable_by_batch_size is not None and (
            isinstance(self.disable_by_batch_size, bool)
            or not isinstance(self.disable_by_batch_size, int)
            or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}"
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError('speculative_config: method "draft_model" needs "model" (the draft model)')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f'speculative_config.model is used only with "method": "draft_model" (got {self.method!r})'
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a ``SpeculativeConfig``, a dict, a JSON object string (the command line's form) or None.
        Raises ValueError naming the key for invalid JSON, an unknown key or a bad value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown} (known: {sorted(known)})")
        if "model" in value and "method" not in value:  # a draft model given alone, as vLLM infers it
            value = {**value, "method": "draft_model"}
        return cls(**value)


@dataclass
class EngineConfig:
    """How to build an ``LLMEngine``. Raises ValueError naming the field for an invalid value."""

    model: str | None = None
    """HF-style model directory (config.json, safetensors, tokenizer.json), a .gguf file, or a Hugging Face
    Hub id (org/name, or org/name:QUANT for a GGUF repository) resolved through the Hub cache
    (HF_HUB_OFFLINE=1: the cache only); default: SmolLM2-135M-Instruct, downloaded and prepared into
    weights/ on first use"""
    revision: str | None = None
    """Hub id only: the branch, tag or commit to use (default: main)"""
    gguf_file: str | None = None
    """Hub id only: the .gguf file of the repository to load"""
    device: Device = "auto"
    """auto uses CUDA when a GPU is usable, else the CPU"""
    dtype: DType = "auto"
    """weights and activations: auto is float32 on the CPU (its only dtype); on CUDA the checkpoint's
    float16/bfloat16, else bfloat16"""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV-cache element type (auto: as dtype; the CPU also takes bfloat16). int8 and fp8 (fp8_e4m3) store
    each token's K and V per KV head as 8-bit values and one float32 scale: 0.27x float32's bytes"""
    block_size: int = 16
    """tokens per KV-cache block (a power of two <= 128)"""
    num_kv_blocks: int | None = None
    """KV-cache pool size in blocks (default: from kv_cache_memory)"""
    kv_cache_memory: int | None = None
    """KV-cache pool size in bytes, e.g. 2GiB or 512MiB (default: 1 GiB on the CPU; on CUDA what
    gpu_memory_utilization leaves after the weights)"""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of the GPU's memory for weights plus KV cache"""
    max_num_seqs: int = 64
    """sequences per engine step at most"""
    max_model_len: int | None = None
    """prompt + generated tokens per sequence at most (default: the model's context)"""
    max_num_batched_tokens: int = 2048
    """token budget per engine step (prefill chunks + decodes)"""
    max_logprobs: int = 20
    """logprobs (and prompt_logprobs) a request may ask for per token at most (vLLM's default 20); -1:
    the whole vocabulary, which a request asks for with -1"""
    max_prefill_tokens_while_decoding: int | None = None
    """prefill tokens per step at most while sequences decode: a prompt that arrives then is chunked
    instead of stalling their next token for its whole prefill (none: max_num_batched_tokens)"""
    enforce_eager: bool = True
    """run every step kernel by kernel; --no-enforce-eager runs decode steps of up to max_num_seqs
    sequences on static input buffers, replayed on CUDA as graphs captured per batch size (padded to
    1, 2, 4, 8, 16, 24, ...). Eager is the default until graphs have run on a GPU; the CPU has no
    graphs and runs the static-buffer path kernel by kernel (padding only costs time there)"""
    fused_decode: bool = True
    """CPU: run the decoder layers of each pure-decode step of up to 128 sequences in one compiled call
    (the same kernels and results as op by op, without a Python call per op); --no-fused-decode runs
    them op by op. No effect on CUDA"""
    enable_prefix_caching: bool = True
    """reuse the KV blocks of identical prompt prefixes across requests"""
    disable_hybrid_kv_cache_manager: bool = False
    """a model whose layers attend differently (sliding-window and full-attention layers, as Gemma 3 or Qwen2
    with use_sliding_window) pages its layers in KV cache groups by attention type, and a sliding group gives
    back the blocks its window has passed; --disable-hybrid-kv-cache-manager (vLLM's name) pages every layer
    together and keeps every block, for comparison (docs/kv_memory.md)"""
    seed: int = 0
    """seed of the generator for requests that give none"""
    quantization: Quantization | None = None
    """weights: gguf keeps a .gguf file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (the default
    for GGUF files; other types are dequantized); q8_0 quantizes a safetensors checkpoint on load. Both
    backends compute on the blocks (CUDA: cuda/quant.cu)"""
    grammar_compile_timeout: float = 10.0
    """seconds a structured-output request waits for its grammar to compile (several compile at once);
    past it the request is refused with a 400 and the compile's result is kept for the next one"""
    reasoning_parser: ReasoningParserName | None = None
    """reasoning models: the server splits <think>...</think> out of chat content into reasoning (and
    reasoning_content), and structured outputs constrain only the text after </think> (none: off). A
    model whose tokenizer has no </think> token is refused with it, as vLLM's parsers refuse it"""
    pooler_config: PoolerConfig | dict | str | None = None
    """embeddings (/v1/embeddings, LLM.embed), a JSON object as vLLM's: '{"pooling_type": "MEAN",
    "normalize": true}'; pooling_type LAST, MEAN or CLS; default: the model's sentence-transformers files
    (modules.json, 1_Pooling/config.json) when present, else LAST, normalized (docs/embeddings.md)"""
    disable_additional_properties: bool = True
    """JSON Schemas (json_schema response formats, structured_outputs.json, tool parameters) compile
    strict: an object that lists its properties admits no other key unless it says additionalProperties
    (as xgrammar, vLLM's default backend, and OpenAI's strict mode); --no-disable-additional-properties
    follows the letter of JSON Schema, where such an object admits any other key"""
    kv_offloading_size: float | None = None
    """GiB for a second KV tier (also --swap-space, vLLM's older name): page-locked host memory on CUDA, a
    memory-mapped file on the CPU. Blocks evicted from the pool and preempted requests' blocks go there
    instead of being dropped; a prefix that comes back is loaded instead of recomputed (docs/kv_memory.md)"""
    kv_offload_dir: str | None = None
    """CPU: the directory of the tier's file, kept across restarts (a new engine with the same model finds
    the cached prefixes); default: a temporary file, removed on close. Needs kv_offloading_size"""
    preemption_mode: PreemptionMode | None = None
    """swap: a preempted request's blocks go to the second tier (when it has room; else recompute);
    recompute: they are dropped and recomputed; default: swap with a tier, else recompute"""
    speculative_config: SpeculativeConfig | dict | str | None = None
    """speculative decoding, a JSON object as vLLM's: '{"method": "ngram", "num_speculative_tokens": 3}';
    methods ngram, suffix, draft_model (with "model": the draft model); docs/speculative_decoding.md;
    default: off"""
    enable_lora: bool = False
    """serve LoRA adapters (PEFT directories) beside the base model, mixed in one batch; offline
    LLM.generate(..., lora_request=LoRARequest(name, id, path)) picks one per prompt, a server's request by its
    model (--lora-modules) (the CPU backend and Llama-family models only; docs/lora.md)"""
    max_loras: int = 1
    """LoRA adapters one step computes with at most (a cap, not a reservation: adapters' weights take pages
    of the KV pool only while resident); a request whose adapter would be one more waits (the ones behind
    it go on)"""
    max_lora_rank: int = 16
    """the highest rank r an adapter may have (vLLM's default 16); a higher one is refused"""
    max_cpu_loras: int | None = None
    """LoRA adapters kept loaded in host memory at most, least recently used dropped beyond it and read
    from disk again when a request needs it (default: every adapter used); at least max_loras"""

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.device not in Device.__args__:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 (the whole vocabulary), got {self.max_logprobs}")
        if self.quantization not in (None, *Quantization.__args__):
            raise ValueError(f"quantization must be one of {Quantization.__args__} or None, got {self.quantization!r}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        if self.preemption_mode not in (None, *PreemptionMode.__args__):
            raise ValueError(f"preemption_mode must be one of {PreemptionMode.__args__} or None")
        if self.kv_offload_dir is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offload_dir keeps a second KV tier on disk: set kv_offloading_size (GiB) too")
        if self.preemption_mode == "swap" and self.kv_offloading_size is None:
            raise ValueError("preemption_mode 'swap' needs a second KV tier: set kv_offloading_size")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (
            isinstance(self.max_cpu_loras, bool)
            or not isinstance(self.max_cpu_loras, int)
            or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}"
            )
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ValueError(
                f"max_prefill_tokens_while_decoding must be >= 1, got {self.max_prefill_tokens_while_decoding}"
            )


def resolve_dtypes(dtype: str, kv_cache_dtype: str, backend, checkpoint_dtype: str | None) -> tuple:
    """The (activation, KV-cache) dtype names the engine runs with on ``backend``: "auto" is
    ``backend.auto_dtype(checkpoint_dtype)`` for ``dtype`` and ``dtype`` for ``kv_cache_dtype`` (float32
    where the backend has no such pair); "fp8" is "fp8_e4m3". Raises ValueError naming
    ``dtype``/``kv_cache_dtype`` for a pair not in ``backend.dtype_pairs``."""
    pairs = backend.dtype_pairs
    kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if dtype == "auto":
        dtype = backend.auto_dtype(checkpoint_dtype)
    if kv_cache_dtype == "auto":
        kv_cache_dtype = dtype if (dtype, dtype) in pairs else "float32"
    if (dtype, kv_cache_dtype) not in pairs:
        if all(a != dtype for a, _ in pairs):
            raise ValueError(
                f"dtype {dtype!r} is not supported on the {backend.name} backend "
                f"(supported: {sorted({a for a, _ in pairs})})"
            )
        supported = ", ".join(f"{a}/{c}" for a, c in pairs)
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} with dtype {dtype!r} is not supported on the "
            f"{backend.name} backend (supported dtype/kv_cache_dtype: {supported})"
        )
    return dtype, kv_cache_dtype
