"""Llama-family decoder forward (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE) over the backend's ops, K/V kept only in the paged cache.

Math as in HF transformers' ``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py`` and
``modeling_qwen3.py``: token embedding; per layer pre-norm RMSNorm -> fused QKV projection (+ bias for
Qwen2) -> per-head RMSNorm of q and k (Qwen3) -> RoPE (rotate-half; the variant's table,
``layers.rotary_embedding``) -> paged attention with GQA (within ``sliding_window`` for Mistral) ->
output projection -> residual; RMSNorm -> SwiGLU MLP (on a mixture of experts' sparse layers the MoE
block, ``layers.fused_moe``) -> residual; final RMSNorm; LM head (tied to the embeddings when
``tie_word_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rawpaged.model_executor.layers.attention import paged_attention_layer
from rawpaged.model_executor.layers.fused_moe import fused_moe, load_moe_weights
from rawpaged.model_executor.layers.rotary_embedding import cos_sin_cache
from rawpaged.model_executor.model_config import ModelConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, for one step.

    Tokens are ordered decodes first (``num_decode_tokens`` of them, one per sequence), then the
    prefill/chunk tokens grouped by sequence.

    slot_mapping: int64 ``[num_tokens]``.
    decode_block_tables: int32 ``[num_decodes, max_blocks]``; decode_context_lens: int32 ``[num_decodes]``.
    prefill_block_tables: int32 ``[num_prefills, max_blocks]``; query_start_loc: int32
    ``[num_prefills + 1]`` (relative to the first prefill token); prefill_seq_lens: int32 ``[num_prefills]``.
    With several KV cache groups, this is the first group's; ``groups`` holds every group's (same fields,
    their own slots and block tables) and ``layer_groups`` each layer's group index.
    """

    slot_mapping: object
    num_decode_tokens: int
    decode_block_tables: object
    decode_context_lens: object
    prefill_block_tables: object
    query_start_loc: object
    prefill_seq_lens: object
    max_query_len: int = 0  # host-side maxima, for launch sizing on the GPU
    max_context_len: int = 0
    groups: tuple = ()
    layer_groups: tuple = ()

    def layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer ``layer_idx`` attends with: its KV cache group's (this one with one group)."""
        if not self.layer_groups:
            return self
        return self.groups[self.layer_groups[layer_idx]]


class LlamaModel:
    """Weights on the backend plus the forward pass.

    Args:
        config: the model's ``ModelConfig``.
        weights: HF name -> host array (any float dtype, typically memory-mapped); each tensor is placed
            on the backend and converted to ``dtype`` one at a time (``backend.load_weight``/``load_linear``).
        backend: ``CPUBackend`` or ``CudaBackend``.
        dtype: compute dtype name for weights/activations: "float32" (CPU), "float16" or "bfloat16".
        max_position: positions the RoPE cache covers (the engine's ``max_model_len``; also the sequence
            length dynamic NTK scaling is computed for).
    """

    def __init__(self, config: ModelConfig, weights: dict, backend, dtype: str = "float32", max_position: int = 2048):
        self.config = config
        self.backend = backend
        self.dtype = dtype
        #: the CPU's fused decode (``cpu_fused_decode``) computes dense Llama layers only
        self.fused_cpu_decode = not config.moe

        def put(name):
            return backend.load_weight(weights[name], dtype)

        def lin(*names):
            return backend.load_linear([weights[n] for n in names], dtype)

        self.embed_tokens = put("model.embed_tokens.weight")
        self.norm = put("model.norm.weight")
        self.lm_head = lin("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
            layer = {
                "input_layernorm": put(p + "input_layernorm.weight"),
                "post_attention_layernorm": put(p + "post_attention_layernorm.weight"),
                "qkv_proj": lin(*[n + ".weight" for n in qkv]),
                "qkv_bias": (
                    backend.load_weight(np.concatenate([weights[n + ".bias"] for n in qkv]), dtype)
                    if config.attention_bias
                    else None
                ),
                "q_norm": put(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                "k_norm": put(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                "o_proj": lin(p + "self_attn.o_proj.weight"),
            }
            if config.moe_layers[i]:
                layer["moe"] = load_moe_weights(config, weights, i, backend, dtype)
            else:
                layer["gate_up_proj"] = lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
                layer["down_proj"] = lin(p + "mlp.down_proj.weight")
            self.layers.append(layer)
        backend.finish_loading()
        inv_freq, attention_factor = config.rope.inv_freq(config.head_dim, config.max_position_embeddings, max_position)
        self.cos_sin_cache = backend.asarray(cos_sin_cache(inv_freq, attention_factor, max_position))
        self.layer_windows = config.layer_windows()
        self.scale = config.head_dim**-0.5

    def forward(self, input_ids, positions, attn: AttentionMetadata, key_caches, value_caches, lora=None):
        """Hidden states after the final norm.

        input_ids, positions: int64 ``[num_tokens]``; caches: per-layer lists of
        ``[num_blocks, block_size, num_kv_heads, head_dim]``. lora: the step's adapters
        (``rawpaged.lora.punica.PunicaWrapper``), added beside each targeted linear, or None. Returns
        ``[num_tokens, hidden]``.
        """
        be, cfg = self.backend, self.config
        T = input_ids.shape[0]
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        residual = be.embedding(input_ids, self.embed_tokens)
        attn_out = be.xp.empty((T, Hq, D), dtype=residual.dtype)
        h = None  # the previous layer's output, added into ``residual`` by the next fused norm
        for i, layer in enumerate(self.layers):
            a, window = attn.layer(i), self.layer_windows[i]
            if h is None:
                x = be.rms_norm(residual, layer["input_layernorm"], cfg.rms_norm_eps)
            else:
                x = be.rms_norm(h, layer["input_layernorm"], cfg.rms_norm_eps, residual=residual)
            qkv = be.linear(x, layer["qkv_proj"], layer["qkv_bias"])
            if lora is not None:
                lora.add_lora(i, "qkv_proj", x, qkv)
            q, k, v = be.split_qkv(qkv, Hq, Hkv, D)
            if layer["q_norm"] is not None:
                q = be.rms_norm(q.reshape(T * Hq, D), layer["q_norm"], cfg.rms_norm_eps).reshape(T, Hq, D)
                k = be.rms_norm(k.reshape(T * Hkv, D), layer["k_norm"], cfg.rms_norm_eps).reshape(T, Hkv, D)
            be.rotary_embedding_and_cache(
                positions, q, k, v, key_caches[i], value_caches[i], a.slot_mapping, self.cos_sin_cache
            )
            paged_attention_layer(be, attn_out, q, key_caches[i], value_caches[i], a, self.scale, window)
            h = be.linear(attn_out.reshape(T, Hq * D), layer["o_proj"])
            if lora is not None:
                lora.add_lora(i, "o_proj", attn_out.reshape(T, Hq * D), h)
            x = be.rms_norm(h, layer["post_attention_layernorm"], cfg.rms_norm_eps, residual=residual)
            if "moe" in layer:
                h = fused_moe(be, x, layer["moe"], cfg)
            elif lora is None:
                h = be.linear(be.silu_and_mul(be.linear(x, layer["gate_up_proj"])), layer["down_proj"])
            else:
                h = _lora_mlp(be, x, layer, lora, i)
        return be.rms_norm(h, self.norm, cfg.rms_norm_eps, residual=residual)

    def compute_logits(self, hidden):
        """float32 logits ``[n, vocab]`` for hidden ``[n, hidden_size]``."""
        return self.backend.linear(hidden, self.lm_head, float32_out=True)


def _lora_mlp(be, x, layer: dict, lora, i: int):
    """Layer ``i``'s SwiGLU MLP with the step's adapters added beside gate/up and down."""
    gate_up = be.linear(x, layer["gate_up_proj"])
    lora.add_lora(i, "gate_up_proj", x, gate_up)
    act = be.silu_and_mul(gate_up)
    h = be.linear(act, layer["down_proj"])
    lora.add_lora(i, "down_proj", act, h)
    return h
