"""A float64 NumPy reference of the decoders rawpaged serves (Llama, Mistral, Qwen2, Qwen3), written from
the published definitions and independent of rawpaged's model code: no paging, no KV cache, the whole
sequence recomputed each step with explicit masks.

Sources: HF transformers ``modeling_llama.py`` (pre-norm decoder, SwiGLU MLP, rotate-half RoPE, GQA by
repeating KV heads), ``modeling_mistral.py`` (sliding window: a query at position i sees keys
``i - sliding_window < j <= i``), ``modeling_qwen2.py`` (q/k/v biases), ``modeling_qwen3.py`` (RMSNorm over
each head of q and k, before RoPE, with an explicit ``head_dim``); ``modeling_rope_utils.py`` for the
RoPE variants (RoFormer, Su et al. 2021; position interpolation, Chen et al. 2023; dynamic NTK; YaRN,
Peng et al. 2023; Llama 3.1). The RoPE functions below take the raw ``config.json`` dict.
"""

from __future__ import annotations

import math

import numpy as np


# ------------------------------------------------------------------------------------------ RoPE
def rope_params(cfg: dict) -> dict:
    """The RoPE parameters of a config in either form, with ``rope_type`` and ``rope_theta``."""
    if cfg.get("rope_parameters") is not None:
        return dict(cfg["rope_parameters"])
    p = dict(cfg.get("rope_scaling") or {})
    p["rope_type"] = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return p


def rope_inv_freq(cfg: dict, seq_len: int) -> tuple:
    """(float64 inverse frequencies ``[head_dim / 2]``, attention factor) for ``config.json`` ``cfg``;
    ``seq_len`` is the sequence length dynamic NTK is evaluated at."""
    p = rope_params(cfg)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = float(p["rope_theta"])
    kind = p["rope_type"]
    half = np.arange(dim // 2, dtype=np.float64)

    def plain(b):
        return 1.0 / b ** (2 * half / dim)

    if kind == "default":
        return plain(base), 1.0
    if kind == "linear":
        return plain(base) / p["factor"], 1.0
    if kind == "dynamic":
        trained = p.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        s = max(seq_len, trained)
        ntk_base = base * ((p["factor"] * s / trained) - (p["factor"] - 1)) ** (dim / (dim - 2))
        return plain(ntk_base), 1.0
    if kind == "llama3":
        freq = plain(base)
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / p["low_freq_factor"], old / p["high_freq_factor"]
        out = np.empty_like(freq)
        for i, f in enumerate(freq):
            wl = 2 * math.pi / f
            if wl < hi_wl:
                out[i] = f
            elif wl > lo_wl:
                out[i] = f / p["factor"]
            else:
                t = (old / wl - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
                out[i] = (1 - t) * f / p["factor"] + t * f
        return out, 1.0
    if kind == "yarn":
        original = p.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        factor = p.get("factor") or cfg["max_position_embeddings"] / original
        fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(fast), correction_dim(slow)
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        freq = plain(base)
        out = np.empty_like(freq)
        for i, f in enumerate(freq):
            ramp = min(1.0, max(0.0, (i - lo) / (hi - lo)))  # 0: extrapolate (keep), 1: interpolate
            out[i] = (f / factor) * ramp + f * (1 - ramp)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = p.get("attention_factor")
        if attn is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                attn = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
            else:
                attn = get_mscale(factor)
        return out, attn
    raise ValueError(kind)


def apply_rope(x, positions, inv_freq, attention_factor):
    """Rotate-half RoPE of ``x [T, heads, D]`` (HF ``apply_rotary_pos_emb``), cos/sin times the factor."""
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :] * attention_factor
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :] * attention_factor
    d = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., d:], x[..., :d]], -1)
    return x * cos + rotated * sin


# ------------------------------------------------------------------------------------------ forward
def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def attention(cfg: dict, g: dict, p: str, h, visible, rope: tuple, qk_norm: bool) -> np.ndarray:
    """Layer prefix ``p``'s self-attention on ``h [T, hidden]`` at positions 0 .. T - 1: q/k/v (with their
    biases where ``g`` has them), per-head RMS norms of q and k with ``qk_norm`` (Qwen3's), RoPE
    (``rope``: ``rope_inv_freq``'s (inv_freq, attention factor)), the KV heads repeated for their query
    heads, a softmax over the keys ``visible [T, T]`` lets each query see, and ``o_proj``: ``[T, hidden]``."""
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    T = h.shape[0]
    pos = np.arange(T)
    q, k, v = (
        (h @ g[p + f"self_attn.{n}_proj.weight"].T + g.get(p + f"self_attn.{n}_proj.bias", 0.0)).reshape(T, heads, D)
        for n, heads in (("q", H), ("k", Hkv), ("v", Hkv))
    )
    if qk_norm:
        q = rms_norm(q, g[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, g[p + "self_attn.k_norm.weight"], eps)
    q = apply_rope(q, pos, *rope)
    k = apply_rope(k, pos, *rope)
    k = np.repeat(k, H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(D)
    scores = np.where(visible[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", probs, v).reshape(T, H * D) @ g[p + "self_attn.o_proj.weight"].T


def layer_windows(cfg: dict) -> list:
    """Each layer's sliding window or None: Mistral windows every layer; Qwen2/Qwen3 with
    ``use_sliding_window`` the layers from ``max_window_layers`` (default 28) on (HF's ``layer_types``)."""
    arch, n, window = cfg["architectures"][0], cfg["num_hidden_layers"], cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return [window] * n
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        return [window if i >= cfg.get("max_window_layers", 28) else None for i in range(n)]
    return [None] * n


def forward(cfg: dict, w: dict, ids: list, seq_len_for_rope: int) -> np.ndarray:
    """float64 logits ``[len(ids), vocab]`` of the whole sequence ``ids``; ``w`` maps HF tensor names to
    arrays. ``seq_len_for_rope``: what dynamic NTK is evaluated at (the engine's max_model_len)."""
    x = final_hidden(cfg, w, ids, seq_len_for_rope)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ np.asarray(head, np.float64).T


def final_hidden(cfg: dict, w: dict, ids: list, seq_len_for_rope: int) -> np.ndarray:
    """float64 hidden states after the final norm ``[len(ids), hidden]`` (what ``forward`` multiplies by
    the LM head; what pooling pools)."""
    arch = cfg["architectures"][0]
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    g = {k: np.asarray(v, np.float64) for k, v in w.items()}
    inv_freq, attn_factor = rope_inv_freq(cfg, seq_len_for_rope)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    causal = j <= i
    x = g["model.embed_tokens.weight"][ids]
    for layer, window in enumerate(layer_windows(cfg)):
        p = f"model.layers.{layer}."
        h = rms_norm(x, g[p + "input_layernorm.weight"], eps)
        visible = causal & (j > i - window) if window else causal

        x = x + attention(cfg, g, p, h, visible, (inv_freq, attn_factor), arch == "Qwen3ForCausalLM")
        h = rms_norm(x, g[p + "post_attention_layernorm.weight"], eps)
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        up = h @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    return rms_norm(x, g["model.norm.weight"], eps)


def greedy_reference(cfg: dict, w: dict, prompt: list, max_tokens: int, seq_len_for_rope: int) -> tuple:
    """(greedy ids, top-2 logit margin of each step) by recomputing the whole sequence each step."""
    ids, margins = list(prompt), []
    for _ in range(max_tokens):
        logits = forward(cfg, w, ids, seq_len_for_rope)[-1]
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :], margins


def decisive_prefix(ids: list, margins: list, min_margin: float = 1e-3) -> int:
    """How many leading steps are decisive: up to the first whose top-2 margin is below ``min_margin``."""
    for i, m in enumerate(margins):
        if m < min_margin:
            return i
    return len(ids)


# ------------------------------------------------------------------------------------------ checkpoints
#: Small shapes per architecture (head_dim 64: a size the CUDA kernels are built for), each testing one
#: of the families' own features: MQA and a computed head_dim (Llama), an explicit head_dim unlike
#: hidden / heads (Qwen2, Qwen3), q/k biases (Qwen2), q/k norms (Qwen3), a window (Mistral), full and
#: sliding layers together (Qwen2 with use_sliding_window: 2 full layers, then 2 with a window of 8).
ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, attention_bias=False, tie_word_embeddings=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=192,
                    num_attention_heads=3, num_key_value_heads=1, sliding_window=12, tie_word_embeddings=False),
    "qwen2_hybrid": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                         num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2),
}  # fmt: skip

#: RoPE variants over a short trained context, so test prompts cross ``original_max_position_embeddings``.
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16},
}  # fmt: skip


def write_checkpoint(dst, arch="llama", rope=None, rope_form="rope_scaling", dtype="float32", num_shards=1, seed=0):
    """Write a random checkpoint of ``ARCHS[arch]`` with RoPE ``rope`` (a ``ROPES`` value) in the config
    form ``rope_form`` ("rope_scaling" or "rope_parameters"), its tensors in ``dtype`` over ``num_shards``
    safetensors files, and a byte-level tokenizer. Returns (config dict, tensors as stored, float64).

    Weights are scaled for decisive logits and peaked attention (so RoPE and masks change the answer):
    embeddings and LM head N(0, 0.5), q/k N(0, 0.15), the rest N(0, 0.1), norm weights 1 + N(0, 0.1).
    """
    import json
    from pathlib import Path

    import ml_dtypes
    from safetensors.numpy import save_file

    from rawpaged.testing.random_model import _byte_tokenizer

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    vocab = _byte_tokenizer(dst)
    cfg = dict(dict(num_hidden_layers=2), **ARCHS[arch], vocab_size=vocab, intermediate_size=128,
               rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, hidden_act="silu",
               torch_dtype=dtype)  # fmt: skip
    # 128 positions in all: linear and dynamic stretch 64 trained positions by their factor of 2
    cfg["max_position_embeddings"] = 64 if rope and rope["rope_type"] in ("linear", "dynamic") else 128
    if rope is not None and rope_form == "rope_parameters":
        cfg["rope_parameters"] = dict(rope, rope_theta=cfg.pop("rope_theta"))
    elif rope is not None:
        cfg["rope_scaling"] = dict(rope)
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or hidden // heads
    rng = np.random.default_rng(seed)

    def w(std, *shape):
        return rng.standard_normal(shape) * std

    t = {"model.embed_tokens.weight": w(0.5, vocab, hidden), "model.norm.weight": 1 + w(0.1, hidden)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(0.5, vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(0.1, hidden)
        t[p + "post_attention_layernorm.weight"] = 1 + w(0.1, hidden)
        t[p + "self_attn.q_proj.weight"] = w(0.15, heads * D, hidden)
        t[p + "self_attn.k_proj.weight"] = w(0.15, kv * D, hidden)
        t[p + "self_attn.v_proj.weight"] = w(0.1, kv * D, hidden)
        t[p + "self_attn.o_proj.weight"] = w(0.1, hidden, heads * D)
        t[p + "mlp.gate_proj.weight"] = w(0.1, 128, hidden)
        t[p + "mlp.up_proj.weight"] = w(0.1, 128, hidden)
        t[p + "mlp.down_proj.weight"] = w(0.1, hidden, 128)
        if arch.startswith("qwen2"):
            for n, rows in (("q", heads * D), ("k", kv * D), ("v", kv * D)):
                t[p + f"self_attn.{n}_proj.bias"] = w(0.1, rows)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + w(0.1, D)
            t[p + "self_attn.k_norm.weight"] = 1 + w(0.1, D)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    stored = {k: v.astype(np_dtype) for k, v in t.items()}
    names = sorted(stored)
    shards = [names[i::num_shards] for i in range(num_shards)]
    if num_shards == 1:
        save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({n: stored[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg, {k: v.astype(np.float64) for k, v in stored.items()}


# ------------------------------------------------------------------------------------------ fixture
#: Prompts for every (architecture, RoPE) pair: short, longer than Mistral's window of 12, beyond every
#: variant's original context (16, 32 or 64 positions), and two sharing a 48-token prefix (12 blocks of
#: 4: prefix-cache hits). MAX_TOKENS greedy tokens each.
_rng = np.random.default_rng(2024)
PROMPTS = [[int(t) for t in _rng.integers(3, 259, n)] for n in (5, 23, 40, 70)]
PROMPTS.append(PROMPTS[3][:48] + [7, 8, 9])
MAX_TOKENS = 12
#: The engine's max_model_len in these tests (each checkpoint's context is 128): dynamic NTK's length.
MAX_MODEL_LEN = 128
FIXTURE = "reference_architectures.json"


def record(path, archs=None) -> dict:
    """Greedy ids and top-2 margins of the float64 reference for every (architecture, RoPE) pair and
    prompt; written to ``path`` (tests/fixtures/reference_architectures.json). ``archs``: record only these
    architectures, keeping the other cases already in ``path``."""
    import json
    import tempfile
    from pathlib import Path

    out = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "max_model_len": MAX_MODEL_LEN, "cases": {}}
    if archs is not None:
        out["cases"] = json.loads(Path(path).read_text())["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs or ARCHS:
            for rope in ROPES:
                cfg, w = write_checkpoint(f"{tmp}/{arch}-{rope}", arch, ROPES[rope])
                runs = [greedy_reference(cfg, w, p, MAX_TOKENS, MAX_MODEL_LEN) for p in PROMPTS]
                out["cases"][f"{arch}/{rope}"] = [
                    {"ids": ids, "margins": [round(m, 6) for m in margins]} for ids, margins in runs
                ]
                print(arch, rope, "min margin", min(min(m) for _, m in runs), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    return out


if __name__ == "__main__":
    import sys
    from pathlib import Path

    record(Path(__file__).parent / "fixtures" / FIXTURE, sys.argv[1:] or None)
