"""Randomly initialised Llama-style and Gemma model directories, and the one table of their shapes
(``SHAPES``), for tests, overhead measurements and device checks that must not depend on downloaded weights.

``write_random_model(dst, ...)`` writes ``config.json`` + ``model.safetensors`` (F32, N(0, 0.02) weights,
unit norms: Gemma's norm weights 0, as its RMSNorm scales by 1 + weight) and copies
``tokenizer.json``/``tokenizer_config.json`` from ``tokenizer_from`` when given (else writes a byte-level
tokenizer with 256 byte tokens + 3 special tokens, vocab 259). ``architecture`` may be a mixture of
experts (``MOE``: Mixtral, Qwen2-MoE, Qwen3-MoE), whose sparse layers get a router and per-expert tensors
in the HF checkpoint layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

#: The one table of random-model shapes (``write_random_model`` keyword arguments), by name:
#: ``tiny`` (the defaults: tests and overhead measurements), ``small`` (the server smoke check's fast
#: shape), the default model's shape and a Llama-like head_dim 128 (timed on a device), and the families'
#: features checked without timings on a device: Q8_0 weights quantized on load, a Mistral window shorter
#: than the longest prompts with YaRN, Qwen3 q/k norms with head_dim 128 unlike hidden / heads,
#: Llama 3 RoPE, and Gemma 2 (soft-caps, every other layer windowed) and Gemma 3 (q/k norms, two RoPEs,
#: a 2:1 pattern of windowed and full layers, head_dim 256) with windows shorter than the longest prompts;
#: and mixtures of experts of each MoE architecture at head_dim 64 (a size the CUDA attention is built for).
SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=72, intermediate_size=64, num_heads=9, num_kv_heads=3, head_dim=8),
    "small": dict(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32),
    "smollm2-135m-shape": dict(
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
    ),
    "llama-like-head128": dict(
        num_layers=8,
        hidden_size=1024,
        intermediate_size=2816,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        vocab_size=32000,
    ),
    "q8_0-on-load": dict(  # the weights in Q8_0 blocks on both backends: cuda/quant.cu on the device
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=32000,
        quantization="q8_0",
    ),
    "mistral-window256-yarn": dict(
        architecture="MistralForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=32000,
        tie_word_embeddings=False,
        sliding_window=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    "qwen3-head128-llama3": dict(
        architecture="Qwen3ForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        vocab_size=32000,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "gemma2-window128": dict(
        architecture="Gemma2ForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=32000,
        sliding_window=128,
    ),
    "gemma3-head256-window128": dict(  # Gemma 3 1B's head_dim and group of 4
        architecture="Gemma3ForCausalLM",
        num_layers=6,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=32000,
        sliding_window=128,
        extra_config={"sliding_window_pattern": 3},
    ),
    # mixtures of experts on a device (scripts/gpu_check.sh): Qwen3-MoE's many small experts with dense and
    # sparse layers mixed, Qwen2-MoE's shared expert, Mixtral's top-2 of 8 with a window
    "qwen3-moe-head64": dict(
        architecture="Qwen3MoeForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=32000,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        mlp_only_layers=(2,),
    ),
    "qwen2-moe-head64": dict(
        architecture="Qwen2MoeForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=32000,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
    ),
    "mixtral-head64": dict(
        architecture="MixtralForCausalLM",
        num_layers=4,
        hidden_size=512,
        intermediate_size=512,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=32000,
        num_experts=8,
        num_experts_per_tok=2,
        sliding_window=256,
    ),
}
_TINY = SHAPES["tiny"]
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
#: tiny mixtures of experts for tests: ``write_random_model(dst, **MOE_SHAPES[arch])``
MOE_SHAPES = {
    "MixtralForCausalLM": dict(architecture="MixtralForCausalLM", hidden_size=64, intermediate_size=32,
                               num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(architecture="Qwen2MoeForCausalLM", num_layers=3, hidden_size=64,
                                intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=6,
                                num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                                decoder_sparse_step=1, mlp_only_layers=(1,)),
    "Qwen3MoeForCausalLM": dict(architecture="Qwen3MoeForCausalLM", num_layers=3, hidden_size=64,
                                intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                                num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
                                decoder_sparse_step=2),
}  # fmt: skip
#: ``MOE_SHAPES`` with every expert, shared-expert and dense width a multiple of 32, for GGUFs with Q8_0 experts
#: (``rawpaged.testing.random_moe_gguf``)
MOE_Q8_SHAPES = {
    "MixtralForCausalLM": dict(MOE_SHAPES["MixtralForCausalLM"], num_experts=4),
    "Qwen2MoeForCausalLM": dict(MOE_SHAPES["Qwen2MoeForCausalLM"], intermediate_size=64, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64),
    "Qwen3MoeForCausalLM": dict(MOE_SHAPES["Qwen3MoeForCausalLM"], intermediate_size=64, moe_intermediate_size=32),
}  # fmt: skip


def _moe_config(architecture, num_experts, num_experts_per_tok, moe_intermediate_size, shared, norm, step, dense):
    """config.json fields of a mixture of experts (HF's names for the architecture)."""
    if architecture == "MixtralForCausalLM":
        return {"num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok}
    cfg = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm,
        "decoder_sparse_step": step,
        "mlp_only_layers": list(dense),
    }
    if architecture == "Qwen2MoeForCausalLM":
        cfg["shared_expert_intermediate_size"] = shared
    return cfg


def _sparse_layer(architecture, i, step, dense) -> bool:
    if architecture == "MixtralForCausalLM":
        return True
    return i not in dense and (i + 1) % step == 0


def _gemma_config(architecture: str, head_dim: int, sliding_window) -> dict:
    """config.json fields a Gemma checkpoint has beside the Llama ones (HF's defaults, a window of
    ``sliding_window`` or 4096; Gemma 3: every other layer windowed)."""
    cfg = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": head_dim,
        "sliding_window": sliding_window or 4096,
        "rms_norm_eps": 1e-6,
    }
    if architecture == "Gemma2ForCausalLM":
        return {**cfg, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    return {**cfg, "sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 10000.0}


def _byte_tokenizer(dst: Path) -> int:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            }
        )
    )
    return len(vocab)


def write_random_model(
    dst,
    *,
    num_layers=_TINY["num_layers"],
    hidden_size=_TINY["hidden_size"],
    intermediate_size=_TINY["intermediate_size"],
    num_heads=_TINY["num_heads"],
    num_kv_heads=_TINY["num_kv_heads"],
    head_dim=_TINY["head_dim"],
    vocab_size=None,
    tokenizer_from=None,
    architecture="LlamaForCausalLM",
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    seed=0,
    sliding_window=None,
    rope_scaling=None,
    extra_config=None,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=None,
    shared_expert_intermediate_size=None,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=(),
    weight_std=0.02,
    num_shards=1,
) -> Path:
    """Write a random model directory at ``dst`` and return it.

    ``vocab_size`` defaults to the tokenizer's size. ``architecture="Qwen2ForCausalLM"`` adds q/k/v
    biases, ``"Qwen3ForCausalLM"`` q/k norms; ``sliding_window`` (Mistral) and ``rope_scaling`` go into
    config.json as given. ``"Gemma2ForCausalLM"``/``"Gemma3ForCausalLM"`` add the pre/post feed-forward
    norms (and Gemma 3's q/k norms) and Gemma's config fields (``_gemma_config``). ``extra_config``: fields
    that override config.json's. Weights are N(0, ``weight_std``) float32, norm weights 1 (Gemma: 0).

    Mixtures of experts (``MOE``): ``num_experts`` experts of ``moe_intermediate_size`` (default
    ``intermediate_size``; Mixtral's is ``intermediate_size``), ``num_experts_per_tok`` a token,
    ``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` (the dense layers get an MLP of
    ``intermediate_size``) and Qwen2-MoE's shared expert of ``shared_expert_intermediate_size`` (default
    ``intermediate_size``). ``num_shards`` > 1 splits the tensors over that many files with an index.
    """
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_from) / f, dst / f)
        tok_size = Tokenizer.from_file(str(dst / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    else:
        tok_size = _byte_tokenizer(dst)
    vocab_size = vocab_size or tok_size
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * weight_std).astype(np.float32)

    gemma = architecture in GEMMA

    def unit(n):  # a norm weight that scales by 1
        return np.zeros(n, np.float32) if gemma else np.ones(n, np.float32)

    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    tensors = {
        "model.embed_tokens.weight": w(vocab_size, hidden_size),
        "model.norm.weight": unit(hidden_size),
    }
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = w(vocab_size, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": unit(hidden_size),
                p + "post_attention_layernorm.weight": unit(hidden_size),
                p + "self_attn.q_proj.weight": w(q, hidden_size),
                p + "self_attn.k_proj.weight": w(kv, hidden_size),
                p + "self_attn.v_proj.weight": w(kv, hidden_size),
                p + "self_attn.o_proj.weight": w(hidden_size, q),
            }
        )
        moe_i = moe_intermediate_size or intermediate_size
        if architecture in MOE and _sparse_layer(architecture, i, decoder_sparse_step, mlp_only_layers):
            tensors.update(_experts(architecture, p, w, hidden_size, num_experts, moe_i))
            if architecture == "Qwen2MoeForCausalLM":
                shared = shared_expert_intermediate_size or intermediate_size
                tensors.update(_mlp(p + "mlp.shared_expert.", w, hidden_size, shared))
                tensors[p + "mlp.shared_expert_gate.weight"] = w(1, hidden_size)
        else:
            tensors.update(_mlp(p + "mlp.", w, hidden_size, intermediate_size))
        if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
            tensors[p + "self_attn.q_norm.weight"] = unit(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = unit(head_dim)
        if gemma:
            tensors[p + "pre_feedforward_layernorm.weight"] = unit(hidden_size)
            tensors[p + "post_feedforward_layernorm.weight"] = unit(hidden_size)
        if architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            tensors.update(
                {
                    p + "self_attn.q_proj.bias": w(q),
                    p + "self_attn.k_proj.bias": w(kv),
                    p + "self_attn.v_proj.bias": w(kv),
                }
            )
    _save(tensors, dst, num_shards)
    model_type = {"Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}.get(
        architecture, architecture.removesuffix("ForCausalLM").lower()
    )
    cfg = {
        "architectures": [architecture],
        "model_type": "gemma3_text" if model_type == "gemma3" else model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "sliding_window": sliding_window,
        "rope_scaling": rope_scaling,
    }
    if gemma:
        cfg.pop("hidden_act")
        cfg.update(_gemma_config(architecture, head_dim, sliding_window))
    if architecture in MOE:
        cfg.update(
            _moe_config(
                architecture,
                num_experts,
                num_experts_per_tok,
                moe_intermediate_size or intermediate_size,
                shared_expert_intermediate_size or intermediate_size,
                norm_topk_prob,
                decoder_sparse_step,
                mlp_only_layers,
            )
        )
    cfg.update(extra_config or {})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _mlp(prefix: str, w, hidden: int, inter: int) -> dict:
    return {
        prefix + "gate_proj.weight": w(inter, hidden),
        prefix + "up_proj.weight": w(inter, hidden),
        prefix + "down_proj.weight": w(hidden, inter),
    }


def _experts(architecture: str, p: str, w, hidden: int, num_experts: int, inter: int) -> dict:
    """A sparse layer's router and experts in the HF checkpoint names (Mixtral: ``block_sparse_moe``,
    ``w1`` gate, ``w3`` up, ``w2`` down)."""
    if architecture == "MixtralForCausalLM":
        tensors = {p + "block_sparse_moe.gate.weight": w(num_experts, hidden)}
        for e in range(num_experts):
            q = p + f"block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": w(inter, hidden), q + "w3.weight": w(inter, hidden)})
            tensors[q + "w2.weight"] = w(hidden, inter)
        return tensors
    tensors = {p + "mlp.gate.weight": w(num_experts, hidden)}
    for e in range(num_experts):
        tensors.update(_mlp(p + f"mlp.experts.{e}.", w, hidden, inter))
    return tensors


def _save(tensors: dict, dst: Path, num_shards: int) -> None:
    """``model.safetensors``, or ``num_shards`` files ``model-0000i-of-0000n.safetensors`` and their index."""
    if num_shards == 1:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
