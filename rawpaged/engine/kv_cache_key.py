"""The KV cache key: every setting that changes the values written into a KV block, in one place.

The prefix cache's hash chains start from this key's digest (``KVCacheManager(cache_keys=...)``), and the
second KV tier's file is named by it and carries it in its header (``kv_offload.KVOffload``). So a block
computed under one configuration is never served to another: a restart with another quantization, weight
dtype, KV dtype, block size, backend or model files finds no hit. A new engine-wide setting that changes KV
values (a new architecture's options) joins ``KVCacheKey``; docs/kv_memory.md lists the fields. A LoRA
adapter, chosen per request, keys its sequences' chains instead (``KVCacheManager.seq_root_hash``).

What is not in it computes the same math: kernel paths (fused decode, CUDA graphs, eager), batch sizes and
scheduling limits, ``max_model_len``, sampling.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rawpaged.weights.fingerprint import model_fingerprint, model_stat_identity


@dataclass(frozen=True)
class KVCacheKey:
    """What a KV block's values depend on besides its tokens (and those before it).

    Attributes:
        model: the model files' identity: a SHA-256 of their contents where blocks outlive the engine
            (a persistent tier), else of their names, sizes and modification times (hashing a model reads
            all of it; an in-memory cache only needs to tell files apart, not to survive a copy).
        dtype: the activation/weight compute dtype ("float32", "bfloat16", ...).
        quantization: the weights' quantization option (None, "q8_0", "gguf").
        kv_cache_dtype: the KV blocks' storage dtype ("float32", "int8", "fp8_e4m3", ...).
        block_size: tokens per block.
        backend: "cpu" or "cuda" (their kernels round differently).
    """

    model: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    block_size: int
    backend: str

    def as_dict(self) -> dict:
        """The fields as a JSON-able dict (the tier file's header keeps it)."""
        return asdict(self)

    @property
    def digest(self) -> str:
        """A hex SHA-256 of the fields (canonical JSON): equal keys, equal digests."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def kv_cache_key(
    model_dir,
    *,
    dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    block_size: int,
    backend: str,
    fingerprint_cache: Path | None = None,
) -> KVCacheKey:
    """The key of an engine. ``fingerprint_cache``: where a content fingerprint of ``model_dir`` is
    remembered (``model_fingerprint``'s JSON file); given, the model is identified by its contents, else
    by its files' names, sizes and times. Raises OSError if a model file cannot be read."""
    if fingerprint_cache is not None:
        model = model_fingerprint(model_dir, fingerprint_cache)
    else:
        model = model_stat_identity(model_dir)
    return KVCacheKey(model, str(dtype), quantization, str(kv_cache_dtype), int(block_size), backend)
