"""A model ready to run over a paged KV pool of its own: the model on its backend, the pool's
``KVCacheManager`` and the ``ModelRunner`` that holds the pool's arrays. The engine builds its target this
way (``engine/engine_parts.py``), and a draft model of speculative decoding builds its own beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.model_executor.model_loader import release_free_heap
from rawpaged.model_executor.model_runner import ModelRunner
from rawpaged.model_executor.models.gemma import GemmaModel
from rawpaged.model_executor.models.llama import LlamaModel
from rawpaged.tokenizer import Tokenizer


@dataclass(frozen=True)
class KVPoolSpec:
    """A paged KV pool: ``num_blocks`` blocks of ``block_size`` tokens, cached as ``kv_cache_dtype``.

    ``enable_prefix_caching``, ``cache_keys`` and ``sliding_window`` go to the ``KVCacheManager``;
    ``kv_cache_groups`` (``kv_cache_groups.group_layers``) to it and the ``ModelRunner`` (None: one group of
    every layer, with ``sliding_window``).
    """

    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    enable_prefix_caching: bool = False
    cache_keys: tuple = ()
    sliding_window: int | None = None
    kv_cache_groups: tuple | None = None


@dataclass(frozen=True)
class RunnerOptions:
    """How the ``ModelRunner`` runs decode steps (``EngineConfig``'s fields of the same names)."""

    enforce_eager: bool = True
    fused_decode: bool = True
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class ModelParts:
    """One model and its pool.

    Attributes:
        model_config: the model's ``ModelConfig``.
        tokenizer: its tokenizer.
        model: the ``LlamaModel`` (weights on the backend, in ``model.dtype``).
        max_model_len: tokens per sequence at most (the model's RoPE cache covers as many positions).
        kv_cache_manager: the pool's manager (``num_blocks``, ``block_size``).
        runner: the ``ModelRunner`` over the pool (its caches in ``kv_cache_dtype``).
        kv_cache_dtype: the cache's dtype name.
    """

    model_config: ModelConfig
    tokenizer: Tokenizer
    model: LlamaModel
    max_model_len: int
    kv_cache_manager: KVCacheManager
    runner: ModelRunner
    kv_cache_dtype: str

    @property
    def backend(self):
        return self.model.backend

    @property
    def dtype(self) -> str:
        return self.model.dtype

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache_manager.block_size


def build_model(model_config: ModelConfig, weights: dict, backend, dtype: str, max_model_len: int) -> LlamaModel:
    """The ``LlamaModel`` (or for Gemma 2/3 the ``GemmaModel``, which has the same interface) of ``weights``
    (HF name -> host array) on ``backend`` in ``dtype``, its RoPE cache over ``max_model_len`` positions.
    ``weights`` is emptied (the model holds what it needs) and the heap that loading freed goes back to
    the OS."""
    cls = GemmaModel if model_config.gemma else LlamaModel
    model = cls(model_config, weights, backend, dtype=dtype, max_position=max_model_len)
    weights.clear()
    release_free_heap()
    return model


def build_model_parts(
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    model: LlamaModel,
    max_model_len: int,
    pool: KVPoolSpec,
    options: RunnerOptions = RunnerOptions(),
    kv_store=None,
    lora_manager=None,
) -> ModelParts:
    """``model``'s pool (``pool``) and runner (``options``; ``kv_store``: the second KV tier's store, or
    None; ``lora_manager``: the adapters' slots, or None), the pool's arrays allocated on the model's
    backend. Raises ValueError for a pool of no block."""
    kv = KVCacheManager(
        pool.num_blocks,
        pool.block_size,
        pool.enable_prefix_caching,
        cache_keys=pool.cache_keys,
        sliding_window=pool.sliding_window,
        groups=pool.kv_cache_groups,
    )
    runner = ModelRunner(
        model,
        pool.num_blocks,
        pool.block_size,
        pool.kv_cache_dtype,
        enforce_eager=options.enforce_eager,
        fused_decode=options.fused_decode,
        max_num_seqs=options.max_num_seqs,
        max_model_len=max_model_len,
        kv_store=kv_store,
        kv_cache_groups=pool.kv_cache_groups,
        lora_manager=lora_manager,
    )
    return ModelParts(model_config, tokenizer, model, max_model_len, kv, runner, pool.kv_cache_dtype)
