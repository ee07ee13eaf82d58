"""A float64 NumPy reference of the mixture-of-experts decoders rawpaged serves (Mixtral, Qwen2-MoE,
Qwen3-MoE), written from HF transformers' modeling files and independent of rawpaged's kernels and model
code: the raw ``config.json`` dict and the checkpoint's own tensor names (per expert), token by token and
expert by expert, the whole sequence recomputed.

Sources (transformers 5.x): ``modeling_mixtral.py`` (``MixtralTopKRouter``: softmax over all experts,
top-k, divided by the top-k sum, which equals a softmax over the k selected logits; ``MixtralExperts``:
``down(silu(gate(x)) * up(x))`` with ``w1`` gate, ``w3`` up, ``w2`` down), ``modeling_qwen2_moe.py``
(``Qwen2MoeTopKRouter``: softmax, top-k, renormalized only with ``norm_topk_prob``; the shared expert
times ``sigmoid(x @ shared_expert_gate.T)``; q/k/v biases; a layer is sparse when it is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``), ``modeling_qwen3_moe.py`` (the same
router, q/k norms, no shared expert). Attention is ``tests/model_reference.py``'s (``attention``).
``torch.topk`` does not specify its order among equal values; here the lower expert index wins a tie.
"""

from __future__ import annotations

import numpy as np

from tests.model_reference import attention, rms_norm, rope_inv_freq


def sparse_layers(cfg: dict) -> list:
    """Each layer's FFN: True for the MoE block, as HF's decoder layers decide it."""
    n = cfg["num_hidden_layers"]
    if cfg["architectures"][0] == "MixtralForCausalLM":
        return [True] * n
    step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def silu_mlp(x, gate, up, down):
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


def route(cfg: dict, logits) -> tuple:
    """(expert ids, weights) of one token's router logits ``[E]``, as HF's router computes them."""
    k = cfg["num_experts_per_tok"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    ids = np.argsort(-probs, kind="stable")[:k]
    w = probs[ids]
    if cfg["architectures"][0] == "MixtralForCausalLM" or cfg.get("norm_topk_prob"):
        w = w / w.sum()
    return ids, w


def moe_block(cfg: dict, g: dict, p: str, h) -> np.ndarray:
    """Layer prefix ``p``'s sparse MoE block on ``h [T, hidden]``, token by token."""
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    q = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        ids, weights = route(cfg, g[q + "gate.weight"] @ h[t])
        for e, wt in zip(ids, weights):
            gate, up, down = (g[q + f"experts.{e}.{n}.weight"] for n in names)
            out[t] += wt * silu_mlp(h[t : t + 1], gate, up, down)[0]
    if p + "mlp.shared_expert_gate.weight" in g:
        s = p + "mlp.shared_expert."
        shared = silu_mlp(h, g[s + "gate_proj.weight"], g[s + "up_proj.weight"], g[s + "down_proj.weight"])
        out += shared / (1 + np.exp(-(h @ g[p + "mlp.shared_expert_gate.weight"].T)))
    return out


def forward(cfg: dict, w: dict, ids: list) -> np.ndarray:
    """float64 logits ``[len(ids), vocab]`` of the whole sequence ``ids``; ``w`` maps the checkpoint's
    tensor names to arrays."""
    arch = cfg["architectures"][0]
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    g = {k: np.asarray(v, np.float64) for k, v in w.items()}
    inv_freq, attn_factor = rope_inv_freq(cfg, T)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = j <= i
    window = cfg.get("sliding_window") if arch == "MixtralForCausalLM" else None
    if window:
        visible = visible & (j > i - window)
    x = g["model.embed_tokens.weight"][ids]
    for layer, sparse in enumerate(sparse_layers(cfg)):
        p = f"model.layers.{layer}."
        h = rms_norm(x, g[p + "input_layernorm.weight"], eps)
        x = x + attention(cfg, g, p, h, visible, (inv_freq, attn_factor), arch == "Qwen3MoeForCausalLM")
        h = rms_norm(x, g[p + "post_attention_layernorm.weight"], eps)
        if sparse:
            x = x + moe_block(cfg, g, p, h)
        else:
            x = x + silu_mlp(
                h, g[p + "mlp.gate_proj.weight"], g[p + "mlp.up_proj.weight"], g[p + "mlp.down_proj.weight"]
            )
    x = rms_norm(x, g["model.norm.weight"], eps)
    head = g["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else g["lm_head.weight"]
    return x @ head.T
