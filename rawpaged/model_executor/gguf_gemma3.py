"""GGUF architecture ``gemma3`` -> HF's ``Gemma3ForCausalLM``: the ``config.json`` dict (as HF's
``Gemma3TextConfig`` writes it), the tensor names, and the norm weights' convention.

The file does not carry three of the config's values; llama.cpp fixes them for ``gemma3`` and so does this
module, each as llama.cpp does (ggml-org/llama.cpp at 0c1e57098, the tree vendored in llama-cpp-python
0.3.36; older trees keep the same code in ``src/llama-model.cpp``, ``llama_model::load_hparams``, case
``LLM_ARCH_GEMMA3``):

- ``layer_types``: every 6th layer (5, 11, 17, ...) full attention, the others sliding, unless the file
  has ``gemma3.attention.sliding_window_pattern`` (a period or a per-layer list): ``src/models/gemma3.cpp``,
  ``llama_model_gemma3::load_arch_hparams`` calls ``load_swa_pattern(ml, 6)``, and
  ``llama_hparams::set_swa_pattern`` (``src/llama-hparams.cpp``) makes layer ``il`` sliding when
  ``il % 6 < 5``. No ``gemma3.attention.sliding_window`` (or 0): every layer full.
- ``rope_local_base_freq`` (the sliding layers' RoPE base): ``gemma3.rope.freq_base_swa`` where present,
  else 10000, the default of ``llama_hparams::rope_freq_base_train_swa`` (``src/llama-hparams.h``), which
  ``llama_model::get_rope_freq_base`` (``src/llama-model.cpp``) gives the sliding layers.
- ``query_pre_attn_scalar``: ``llama_model_gemma3::load_arch_hparams`` scales queries by
  ``1 / sqrt(head_dim)``, and by ``1 / sqrt(hidden / heads)`` for the 27B model (62 layers): the scalar
  is ``head_dim``, or ``hidden / heads`` for 62 layers (HF's 27B config says 168 = 5376 / 32).

Norms: HF's ``Gemma3RMSNorm`` computes ``x * (1 + w)``; llama.cpp's converter writes ``1 + w`` into the
GGUF for every tensor whose HF name ends in ``norm.weight`` (``conversion/gemma.py``,
``Gemma3Model.norm_shift`` / ``modify_tensors``): the four norms of each layer, ``q_norm``, ``k_norm``
and the final norm, so :func:`unshift_norm` subtracts 1 from each. llama.cpp does not permute Q/K rows
for Gemma (its converter's ``Gemma3Model`` is no ``LlamaModel``; RoPE is NeoX-style, HF's rotate_half).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: GGUF layer tensor (without ``blk.N.`` and the suffix) -> HF name, where Gemma 3 differs from Llama
LAYER_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
SWA_PERIOD = 6  # llama.cpp: load_swa_pattern(ml, 6)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: llama_hparams::rope_freq_base_train_swa's default


def layer_types(n_layer: int, window: int | None, pattern: Any) -> list[str]:
    """Each layer's attention type as llama.cpp derives it (see the module's docstring).

    Args:
        n_layer: the number of layers.
        window: ``gemma3.attention.sliding_window``, or None.
        pattern: ``gemma3.attention.sliding_window_pattern``: None, a period, or one bool per layer.

    Raises:
        ValueError: a per-layer pattern of another length, or a period under 1.
    """
    if not window:
        return ["full_attention"] * n_layer
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layer:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
        sliding = [bool(p) for p in pattern]
    else:
        period = SWA_PERIOD if pattern is None else int(pattern)
        if period < 0:
            raise ValueError(f"sliding_window_pattern {period} must be at least 0")
        sliding = [period == 0 or il % period < period - 1 for il in range(n_layer)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gemma3_config(meta: dict, n_tokens: int, tied: bool) -> dict:
    """The HF ``config.json`` dict of a ``gemma3`` GGUF.

    Args:
        meta: the file's ``gemma3.*`` keys without the prefix (``block_count``, ...) and the
            ``tokenizer.ggml.*`` token ids without theirs (``bos_token_id``, ...), as plain values (floats
            read from float32 as their shortest decimal, ``1e-06``); missing optional keys absent.
        n_tokens: the length of ``tokenizer.ggml.tokens``.
        tied: no ``output.weight``: the LM head is the embedding.

    Returns:
        The dict (fields of HF's ``Gemma3TextConfig``; ``torch_dtype`` ``float32``).

    Raises:
        KeyError naming a required key that is missing; ValueError for a bad sliding-window pattern.
    """
    hidden = int(meta["embedding_length"])
    n_head = int(meta["attention.head_count"])
    n_layer = int(meta["block_count"])
    head_dim = int(meta.get("attention.key_length") or 256)
    window = int(meta.get("attention.sliding_window") or 0) or None
    types = layer_types(n_layer, window, meta.get("attention.sliding_window_pattern"))
    cap = float(meta.get("final_logit_softcapping") or 0.0) or None
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(meta["feed_forward_length"]),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("attention.head_count_kv") or n_head),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(meta.get("rope.freq_base_swa", LOCAL_ROPE_BASE)),
        "rope_scaling": None,
        "sliding_window": window,
        "layer_types": types,
        "query_pre_attn_scalar": hidden // n_head if n_layer == 62 else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cap,
        "attention_bias": False,
        "max_position_embeddings": int(meta.get("context_length", 131072)),
        "vocab_size": int(meta.get("vocab_size", n_tokens)),
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta.get("bos_token_id", 2)),
        "eos_token_id": int(meta.get("eos_token_id", 1)),
        "torch_dtype": "float32",
    }
    if meta.get("padding_token_id") is not None:
        config["pad_token_id"] = int(meta["padding_token_id"])
    return config


def unshift_norm(w: np.ndarray) -> np.ndarray:
    """A GGUF Gemma norm weight (``1 + w``, float32) -> HF's ``w``. Exact wherever ``1 + w >= 0.5``
    (float32 subtraction of 1 from a value in [0.5, 2] is exact, Sterbenz's lemma; above 2 as well)."""
    return (np.asarray(w, dtype=np.float32) - np.float32(1.0)).astype(np.float32, copy=False)
