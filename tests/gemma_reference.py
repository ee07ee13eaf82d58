"""A float64 NumPy reference of the Gemma 2 and Gemma 3 decoders, written from HF transformers'
``modeling_gemma2.py``, ``modeling_gemma3.py``, ``configuration_gemma2.py`` and ``configuration_gemma3.py``
and independent of rawpaged's model code: no paging, no KV cache, the whole sequence recomputed with
explicit masks.

What the HF files define, and this reference follows:

- ``Gemma*RMSNorm``: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``.
- ``Gemma3TextScaledWordEmbedding`` / ``Gemma2Model.forward``: embeddings times ``sqrt(hidden_size)``.
- ``Gemma*DecoderLayer``: ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then ``x +
  post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.
- ``Gemma*MLP``: ``down(gelu_pytorch_tanh(gate(x)) * up(x))``.
- ``Gemma*Attention``: scores ``q k^T * query_pre_attn_scalar ** -0.5``; Gemma 3 normalizes q and k per
  head (``q_norm``/``k_norm``, before RoPE); Gemma 2 passes ``softcap=attn_logit_softcapping`` to the
  attention (``eager_attention_forward``: ``tanh(s / cap) * cap`` before the mask), Gemma 3 does not.
- masks: causal; on ``sliding_attention`` layers a query at position i sees keys ``i - W < j <= i``.
- ``layer_types``: explicit, else Gemma 2 ``"sliding_attention" if (i + 1) % 2 else "full_attention"``,
  Gemma 3 the same with ``sliding_window_pattern`` (default 6) in place of 2.
- RoPE: Gemma 2 one table from ``rope_theta``; Gemma 3 ``rope_local_base_freq`` (default 10000, no scaling)
  on the sliding layers, ``rope_theta`` (default 1e6) with ``rope_scaling`` on the full ones.
- ``Gemma*ForCausalLM``: logits from the tied embeddings (or ``lm_head``), then ``tanh(logits / cap) * cap``
  with ``final_logit_softcapping``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tests.model_reference import apply_rope, rope_inv_freq


def layer_types(cfg: dict) -> list:
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    gemma2 = cfg["architectures"][0] == "Gemma2ForCausalLM"
    every = 2 if gemma2 else cfg.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(cfg["num_hidden_layers"])]


def gemma_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def soft_cap(x, cap):
    return x if cap is None else np.tanh(x / cap) * cap


def _ropes(cfg: dict, seq_len: int) -> dict:
    """layer type -> (inv_freq, attention factor)."""
    if cfg["architectures"][0] == "Gemma2ForCausalLM":
        full = rope_inv_freq(cfg, seq_len)
        return {"full_attention": full, "sliding_attention": full}
    full = rope_inv_freq({**cfg, "rope_theta": cfg.get("rope_theta", 1e6)}, seq_len)
    local = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
    local["rope_theta"] = cfg.get("rope_local_base_freq", 10000.0)
    return {"full_attention": full, "sliding_attention": rope_inv_freq(local, seq_len)}


def forward(cfg: dict, w: dict, ids: list, seq_len_for_rope: int = 128) -> np.ndarray:
    """float64 logits ``[len(ids), vocab]`` of the whole sequence ``ids`` (``w``: HF name -> array)."""
    gemma2 = cfg["architectures"][0] == "Gemma2ForCausalLM"
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    g = {k: np.asarray(v, np.float64) for k, v in w.items()}
    T = len(ids)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ropes = _ropes(cfg, seq_len_for_rope)
    scale = cfg.get("query_pre_attn_scalar", 256) ** -0.5
    attn_cap = cfg.get("attn_logit_softcapping", 50.0) if gemma2 else None
    pos = np.arange(T)
    x = g["model.embed_tokens.weight"][ids] * math.sqrt(cfg["hidden_size"])
    for layer, kind in enumerate(layer_types(cfg)):
        p = f"model.layers.{layer}."
        h = gemma_norm(x, g[p + "input_layernorm.weight"], eps)
        q = (h @ g[p + "self_attn.q_proj.weight"].T).reshape(T, H, D)
        k = (h @ g[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D)
        v = (h @ g[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
        if not gemma2:
            q = gemma_norm(q, g[p + "self_attn.q_norm.weight"], eps)
            k = gemma_norm(k, g[p + "self_attn.k_norm.weight"], eps)
        q, k = (apply_rope(t, pos, *ropes[kind]) for t in (q, k))
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        scores = soft_cap(np.einsum("ihd,jhd->hij", q, k) * scale, attn_cap)
        visible = j <= i
        if kind == "sliding_attention":
            visible = visible & (j > i - cfg.get("sliding_window", 4096))
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", probs, v).reshape(T, H * D) @ g[p + "self_attn.o_proj.weight"].T
        x = x + gemma_norm(attn, g[p + "post_attention_layernorm.weight"], eps)
        h = gemma_norm(x, g[p + "pre_feedforward_layernorm.weight"], eps)
        mlp = (gelu_tanh(h @ g[p + "mlp.gate_proj.weight"].T) * (h @ g[p + "mlp.up_proj.weight"].T)) @ g[
            p + "mlp.down_proj.weight"
        ].T
        x = x + gemma_norm(mlp, g[p + "post_feedforward_layernorm.weight"], eps)
    x = gemma_norm(x, g["model.norm.weight"], eps)
    head = g["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", True) else g["lm_head.weight"]
    return soft_cap(x @ head.T, cfg.get("final_logit_softcapping", 30.0 if gemma2 else None))


def greedy_reference(cfg: dict, w: dict, prompt: list, max_tokens: int) -> tuple:
    """(greedy ids, top-2 logit margin of each step), the whole sequence recomputed each step."""
    ids, margins = list(prompt), []
    for _ in range(max_tokens):
        logits = forward(cfg, w, ids)[-1]
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :], margins


#: Small configs (head_dim 64: a size the CUDA kernels are built for) with a window of 8 (blocks of 4),
#: soft-caps small enough to bend the scores and logits, and a query_pre_attn_scalar unlike head_dim.
CONFIGS = {
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, query_pre_attn_scalar=48,
                   attn_logit_softcapping=4.0, final_logit_softcapping=6.0, tie_word_embeddings=True),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=1, query_pre_attn_scalar=64,
                   sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=10000.0,
                   final_logit_softcapping=None, tie_word_embeddings=True),
    "gemma3-linear-untied": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                 query_pre_attn_scalar=64, layer_types=["full_attention", "sliding_attention"],
                                 rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                 final_logit_softcapping=12.0, tie_word_embeddings=False),
}  # fmt: skip


def write_checkpoint(dst, name: str, seed: int = 0) -> tuple:
    """Write a random checkpoint of ``CONFIGS[name]`` (float32, byte-level tokenizer) at ``dst``. Returns
    (config dict, float64 tensors). Weights scaled for decisive logits and peaked attention: embeddings
    and LM head N(0, 0.5), q/k N(0, 0.3), the rest N(0, 0.1); norm weights N(0, 0.2) (scaling by 1 + w)."""
    from safetensors.numpy import save_file

    from rawpaged.testing.random_model import _byte_tokenizer

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    vocab = _byte_tokenizer(dst)
    hidden, inter = 128, 128
    cfg = dict(CONFIGS[name], vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, head_dim=64,
               rms_norm_eps=1e-6, max_position_embeddings=128, sliding_window=8, bos_token_id=1, eos_token_id=2,
               hidden_activation="gelu_pytorch_tanh", torch_dtype="float32")  # fmt: skip
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rng = np.random.default_rng(seed)

    def w(std, *shape):
        return rng.standard_normal(shape) * std

    t = {"model.embed_tokens.weight": w(0.5, vocab, hidden), "model.norm.weight": w(0.2, hidden)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(0.5, vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + f"{n}_layernorm.weight"] = w(0.2, hidden)
        t[p + "self_attn.q_proj.weight"] = w(0.3, H * D, hidden)
        t[p + "self_attn.k_proj.weight"] = w(0.3, Hkv * D, hidden)
        t[p + "self_attn.v_proj.weight"] = w(0.1, Hkv * D, hidden)
        t[p + "self_attn.o_proj.weight"] = w(0.1, hidden, H * D)
        t[p + "mlp.gate_proj.weight"] = w(0.1, inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(0.1, inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(0.1, hidden, inter)
        if cfg["architectures"][0] == "Gemma3ForCausalLM":
            t[p + "self_attn.q_norm.weight"] = w(0.2, D)
            t[p + "self_attn.k_norm.weight"] = w(0.2, D)
    stored = {k: v.astype(np.float32) for k, v in t.items()}
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg, {k: v.astype(np.float64) for k, v in stored.items()}
