"""An engine's parts, built once from its ``EngineConfig``: the model and its pool (``model_executor/model_parts.py``),
the KV cache key and second KV tier, the scheduler, the front end that checks requests, the output processor
and the speculator. ``LLMEngine`` runs with them; a draft model of speculative decoding builds its own model
parts the same way; a data-parallel front end builds the same ``FrontEnd`` from a replica's description.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from rawpaged.config import EngineConfig, resolve_dtypes
from rawpaged.core.kv_cache_groups import group_layers, group_size
from rawpaged.core.kv_tier import KVTier
from rawpaged.core.scheduler import Scheduler
from rawpaged.engine.input_processor import InputProcessor
from rawpaged.engine.kv_cache_key import KVCacheKey, kv_cache_key
from rawpaged.engine.kv_offload import KVOffload, fingerprint_dir
from rawpaged.engine.output_processor import OutputProcessor
from rawpaged.lora.models import LoRAModelManager
from rawpaged.model_executor.model_config import GenerationConfig
from rawpaged.model_executor.model_loader import load_model
from rawpaged.model_executor.model_parts import KVPoolSpec, ModelParts, RunnerOptions, build_model, build_model_parts
from rawpaged.model_executor.model_runner import kv_block_bytes
from rawpaged.spec_decode.speculator import Speculator
from rawpaged.tokenizer import Tokenizer
from rawpaged.weights.resolve import resolve_model_dir

logger = logging.getLogger("rawpaged.engine")


@dataclass(frozen=True)
class FrontEnd:
    """What takes a request in before a scheduler sees it: the tokenizer and the ``InputProcessor`` that
    checks prompts against the model and the pool (``build_front_end``)."""

    tokenizer: Tokenizer
    input_processor: InputProcessor

    def describe(self) -> dict:
        """What ``from_description`` needs to make the same front end elsewhere (JSON-able; the tokenizer
        travels as its JSON and config)."""
        p = self.input_processor
        return {
            "tokenizer_json": self.tokenizer.to_json(),
            "tokenizer_config": self.tokenizer.to_config(),
            "vocab_size": p.vocab_size,
            "max_model_len": p.max_model_len,
            "num_blocks": p.num_blocks,
            "group_windows": list(p.group_windows),
        }

    @classmethod
    def from_description(cls, config: EngineConfig, info: dict) -> FrontEnd:
        """The front end of an engine on ``config`` that ``describe`` gave ``info``."""
        tokenizer = Tokenizer.from_objects(HFTokenizer.from_str(info["tokenizer_json"]), info["tokenizer_config"])
        limits = (info["vocab_size"], info["max_model_len"], info["num_blocks"], tuple(info["group_windows"]))
        return build_front_end(config, tokenizer, *limits)


def build_front_end(
    config: EngineConfig,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    group_windows: tuple,
) -> FrontEnd:
    """The ``FrontEnd`` of an engine on ``config`` whose model has ``vocab_size`` tokens, its pool
    ``num_blocks`` blocks paged in KV cache groups of ``group_windows`` (each group's window, None: full
    attention)."""
    processor = InputProcessor(
        tokenizer,
        vocab_size,
        max_model_len,
        config.block_size,
        num_blocks,
        group_windows=group_windows,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_logprobs=config.max_logprobs,
    )
    return FrontEnd(tokenizer, processor)


@dataclass(frozen=True)
class EngineParts:
    """Attributes:
    config: the engine's configuration.
    model_dir: the model's resolved directory (or GGUF file).
    generation_config: its ``generation_config.json``.
    target: the model and its pool (``ModelParts``).
    kv_block_bytes: bytes of one pool block, every layer's K and V.
    eos_token_ids: the ids that end a sequence (the model's, generation config's and tokenizer's).
    kv_cache_key: what the cached KV depends on (``KVCacheKey``).
    kv_offload: the second KV tier (``KVOffload``), or None.
    scheduler: the ``Scheduler`` over the target's pool (and the tier).
    front_end: the tokenizer and ``InputProcessor``.
    output_processor: the ``OutputProcessor``.
    reasoning_end_token_id: the id of ``</think>`` with a reasoning parser, else None.
    speculator: the ``Speculator`` of ``config.speculative_config``, or None.
    """

    config: EngineConfig
    model_dir: Path
    generation_config: GenerationConfig
    target: ModelParts
    kv_block_bytes: int
    eos_token_ids: set
    kv_cache_key: KVCacheKey
    kv_offload: KVOffload | None
    scheduler: Scheduler
    front_end: FrontEnd
    output_processor: OutputProcessor
    reasoning_end_token_id: int | None
    speculator: Speculator | None


def build_engine_parts(config: EngineConfig, backend) -> EngineParts:
    """The parts of an engine on ``config``, its model on ``backend``.

    Raises ValueError for a bad model directory or configuration (``max_model_len`` over the model's
    context, a tier that holds no block, a ``reasoning_parser`` the tokenizer cannot serve, a bad draft
    model).
    """
    model_dir = resolve_model_dir(config.model, config.revision, config.gguf_file)
    mc, tokenizer, gen, weights = load_model(model_dir, config.quantization)
    if gen.ignored:
        logger.warning("generation_config.json: %s not applied (not supported)", ", ".join(gen.ignored))
    if config.max_model_len is not None and config.max_model_len > mc.context_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context of {mc.context_len} tokens "
            "(max_position_embeddings, stretched by RoPE scaling)"
        )
    max_model_len = config.max_model_len or mc.context_len
    dtype, kv_dtype = resolve_dtypes(config.dtype, config.kv_cache_dtype, backend, mc.torch_dtype)
    model = build_model(mc, weights, backend, dtype, max_model_len)
    groups = group_layers(mc.layer_windows(), hybrid=not config.disable_hybrid_kv_cache_manager)
    block_bytes = kv_block_bytes(group_size(groups), config.block_size, mc.num_key_value_heads, mc.head_dim, kv_dtype)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:  # after the weights: on CUDA the budget is what they left free
        budget = config.kv_cache_memory or backend.default_kv_cache_memory(config.gpu_memory_utilization)
        num_blocks = max(1, budget // block_bytes)
    eos_token_ids = set(mc.eos_token_ids) | set(gen.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_token_ids.add(tokenizer.eos_token_id)
    key, tier = _kv_key_and_tier(config, model_dir, backend, dtype, kv_dtype, block_bytes, mc, group_size(groups))
    pool = KVPoolSpec(
        num_blocks, config.block_size, kv_dtype, config.enable_prefix_caching, (key.digest,), kv_cache_groups=groups
    )
    options = RunnerOptions(config.enforce_eager, config.fused_decode, config.max_num_seqs)
    lora = lora_manager(config, mc, backend)
    target = build_model_parts(mc, tokenizer, model, max_model_len, pool, options, tier.store if tier else None, lora)
    return EngineParts(
        config,
        model_dir,
        gen,
        target,
        block_bytes,
        eos_token_ids,
        key,
        tier,
        _scheduler(config, target, eos_token_ids, tier),
        build_front_end(
            config, tokenizer, mc.vocab_size, max_model_len, num_blocks, tuple(g.sliding_window for g in groups)
        ),
        OutputProcessor(tokenizer),
        reasoning_end_token_id(tokenizer, config.reasoning_parser),
        build_speculator(config.speculative_config, target),
    )


def _kv_key_and_tier(config, model_dir, backend, dtype, kv_dtype, block_bytes, mc, layers_per_block: int) -> tuple:
    """The engine's ``KVCacheKey`` and its second KV tier (``KVOffload``, or None), whose slots hold a pool
    block's ``layers_per_block`` layers."""
    tier_dir = fingerprint_dir(config)
    key = kv_cache_key(
        model_dir,
        dtype=dtype,
        quantization=config.quantization,
        kv_cache_dtype=kv_dtype,
        block_size=config.block_size,
        backend=backend.name,
        fingerprint_cache=tier_dir / "model-fingerprints.json" if tier_dir is not None else None,
    )
    geometry = dict(num_layers=layers_per_block, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim)
    return key, KVOffload.from_config(config, backend, key, block_bytes, geometry, kv_dtype)


def _scheduler(config: EngineConfig, target: ModelParts, eos_token_ids: set, tier: KVOffload | None) -> Scheduler:
    """The scheduler over ``target``'s pool; with a tier, swap is the default preemption."""
    kv = target.kv_cache_manager
    return Scheduler(
        kv,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        target.max_model_len,
        eos_token_ids,
        max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
        preemption_mode=config.preemption_mode or ("swap" if tier else "recompute"),
        kv_tier=KVTier(kv, tier.manager, write_through=tier.persistent) if tier else None,
        max_loras=config.max_loras if config.enable_lora else None,
        lora_source=target.runner.lora_manager,
    )


def lora_manager(config: EngineConfig, model_config, backend) -> LoRAModelManager | None:
    """The adapters' registry, host copies (loaded in the background) and slots with ``enable_lora`` (else
    None). Raises ValueError where LoRA cannot run yet:
    a backend other than the CPU, or a Gemma model."""
    if not config.enable_lora:
        return None
    if backend.name != "cpu":
        raise ValueError(f"enable_lora: the {backend.name} backend has no LoRA kernels yet (use device='cpu')")
    if model_config.gemma:
        raise ValueError(f"enable_lora: {model_config.architecture} does not take LoRA adapters yet")
    return LoRAModelManager(
        model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras, load_in_background=True
    )


def build_speculator(spec, target: ModelParts) -> Speculator | None:
    """The ``Speculator`` of ``speculative_config`` (None: off); a draft model runs beside ``target``, on
    its backend and dtypes, with a pool of as many blocks of its own. Raises ValueError naming
    ``speculative_config.model`` for a draft model that cannot be found."""
    if spec is None:
        return None
    if spec.method == "draft_model":
        try:
            spec = dataclasses.replace(spec, model=str(resolve_model_dir(spec.model)))
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
    return Speculator(spec, target.max_model_len, target)


def reasoning_end_token_id(tokenizer, reasoning_parser: str | None) -> int | None:
    """The id of ``</think>`` for ``reasoning_parser`` (None without one). Raises ValueError naming the
    option when the tokenizer has no such single token."""
    if reasoning_parser is None:
        return None
    ids = tokenizer.encode("</think>", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"reasoning_parser {reasoning_parser!r}: this tokenizer has no </think> token")
    return ids[0]
