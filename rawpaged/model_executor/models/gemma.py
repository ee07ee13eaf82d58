"""Gemma 2 and Gemma 3 decoder forward over the backend's ops, K/V kept only in the paged cache.

Math as in HF transformers' ``modeling_gemma2.py`` and ``modeling_gemma3.py``: token embedding times
``sqrt(hidden_size)`` (the normalizer rounded to the activation dtype); per layer RMSNorm -> QKV projection
-> per-head RMSNorm of q and k (Gemma 3) -> RoPE (Gemma 3: ``rope_local_base_freq`` on the sliding layers,
``rope_theta`` with its scaling on the full ones) -> paged attention with GQA, scores scaled by
``query_pre_attn_scalar ** -0.5`` and soft-capped (Gemma 2's ``attn_logit_softcapping``), within the
layer's window on the sliding layers -> output projection -> RMSNorm -> residual; RMSNorm -> GeGLU MLP
(tanh GeLU) -> RMSNorm -> residual; final RMSNorm; LM head tied to the embeddings (or ``lm_head``), its
float32 logits soft-capped by ``final_logit_softcapping``.

Every Gemma RMSNorm multiplies by ``1 + weight`` in float32: the norm weights are loaded as float32 ``1 +
weight`` (the kernels take float32 weights beside any activation dtype).
"""

from __future__ import annotations

import numpy as np

from rawpaged.model_executor.layers.attention import paged_attention_layer
from rawpaged.model_executor.layers.rotary_embedding import cos_sin_cache
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.model_executor.models.llama import AttentionMetadata

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaModel:
    """Weights on the backend plus the forward pass of a Gemma 2 or Gemma 3 decoder (``config.gemma``).

    Args: as ``LlamaModel``'s (config, weights HF name -> host array, backend, dtype, max_position).
    """

    def __init__(self, config: ModelConfig, weights: dict, backend, dtype: str = "float32", max_position: int = 2048):
        if not config.gemma:
            raise ValueError(f"GemmaModel runs Gemma 2 and Gemma 3, not {config.architecture}")
        self.config = config
        self.backend = backend
        self.dtype = dtype

        def norm(name):  # HF's Gemma RMSNorm: x * (1 + weight), computed in float32
            return backend.load_weight(1.0 + np.asarray(weights[name], dtype=np.float32), "float32")

        def lin(*names):
            return backend.load_linear([weights[n] for n in names], dtype)

        self.embed_tokens = backend.load_weight(weights["model.embed_tokens.weight"], dtype)
        self.norm = norm("model.norm.weight")
        self.lm_head = lin("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = {n: norm(p + n + ".weight") for n in NORMS}
            layer.update(
                qkv_proj=lin(*[p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                q_norm=norm(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                o_proj=lin(p + "self_attn.o_proj.weight"),
                gate_up_proj=lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down_proj=lin(p + "mlp.down_proj.weight"),
            )
            self.layers.append(layer)
        backend.finish_loading()
        tables = {}
        for rope in set(config.layer_ropes()):
            inv_freq, factor = rope.inv_freq(config.head_dim, config.max_position_embeddings, max_position)
            tables[rope] = backend.asarray(cos_sin_cache(inv_freq, factor, max_position))
        #: each layer's RoPE table (two tables in all for Gemma 3: the sliding layers' and the full ones')
        self.layer_cos_sin = [tables[rope] for rope in config.layer_ropes()]
        self.layer_windows = config.layer_windows()
        self.scale = config.attention_scale
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.soft_cap = config.attn_logit_softcapping

    def forward(self, input_ids, positions, attn: AttentionMetadata, key_caches, value_caches):
        """Hidden states after the final norm.

        input_ids, positions: int64 ``[num_tokens]``; caches: per-layer lists of
        ``[num_blocks, block_size, num_kv_heads, head_dim]``. Returns ``[num_tokens, hidden]``.
        """
        be, eps = self.backend, self.config.rms_norm_eps
        residual = be.embedding(input_ids, self.embed_tokens, scale=self.embed_scale)
        h = None  # the previous layer's output, added into ``residual`` by the next fused norm
        for i, layer in enumerate(self.layers):
            if h is None:
                x = be.rms_norm(residual, layer["input_layernorm"], eps)
            else:
                x = be.rms_norm(h, layer["input_layernorm"], eps, residual=residual)
            h = be.rms_norm(
                self._attention(i, x, positions, attn, key_caches, value_caches), layer["post_attention_layernorm"], eps
            )
            x = be.rms_norm(h, layer["pre_feedforward_layernorm"], eps, residual=residual)
            h = be.linear(be.gelu_tanh_and_mul(be.linear(x, layer["gate_up_proj"])), layer["down_proj"])
            h = be.rms_norm(h, layer["post_feedforward_layernorm"], eps)
        return be.rms_norm(h, self.norm, eps, residual=residual)

    def _attention(self, i: int, x, positions, attn: AttentionMetadata, key_caches, value_caches):
        """Layer ``i``'s attention block on its normed input ``x [T, hidden]``: the output projection of
        its attention ``[T, hidden]``, the step's K/V written to layer ``i``'s caches."""
        be, cfg, layer = self.backend, self.config, self.layers[i]
        T = x.shape[0]
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a, window = attn.layer(i), self.layer_windows[i]
        q, k, v = be.split_qkv(be.linear(x, layer["qkv_proj"]), Hq, Hkv, D)
        if layer["q_norm"] is not None:
            q = be.rms_norm(q.reshape(T * Hq, D), layer["q_norm"], cfg.rms_norm_eps).reshape(T, Hq, D)
            k = be.rms_norm(k.reshape(T * Hkv, D), layer["k_norm"], cfg.rms_norm_eps).reshape(T, Hkv, D)
        be.rotary_embedding_and_cache(
            positions, q, k, v, key_caches[i], value_caches[i], a.slot_mapping, self.layer_cos_sin[i]
        )
        out = be.xp.empty((T, Hq, D), dtype=q.dtype)
        paged_attention_layer(be, out, q, key_caches[i], value_caches[i], a, self.scale, window, self.soft_cap)
        return be.linear(out.reshape(T, Hq * D), layer["o_proj"])

    def compute_logits(self, hidden):
        """float32 logits ``[n, vocab]`` for hidden ``[n, hidden_size]``, soft-capped (``cap * tanh(logits /
        cap)``) where the config has ``final_logit_softcapping``."""
        logits = self.backend.linear(hidden, self.lm_head, float32_out=True)
        cap = self.config.final_logit_softcapping
        if cap:
            logits /= np.float32(cap)
            self.backend.xp.tanh(logits, out=logits)
            logits *= np.float32(cap)
        return logits
