"""Random LoRA adapters in PEFT's layout, for tests: ``write_random_adapter(dst, model_dir, ...)`` writes
``adapter_config.json`` and ``adapter_model.safetensors`` (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``,
float32 N(0, ``std``)) for the targeted linears of every layer of the Llama-style model at ``model_dir``,
and ``merged_weights`` gives a model's weights with ``W + scale * B @ A`` folded in (float64)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in ALL_MODULES}


def _shapes(cfg: dict) -> dict:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_random_adapter(
    dst,
    model_dir,
    *,
    rank: int = 8,
    lora_alpha: float = 16.0,
    target_modules=ALL_MODULES,
    use_rslora: bool = False,
    std: float = 0.05,
    seed: int = 0,
    extra_config: dict | None = None,
) -> Path:
    """Write a random adapter directory at ``dst`` for the model at ``model_dir`` and return it.
    ``extra_config``: fields that override ``adapter_config.json``'s."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in target_modules:
            fan_in, fan_out = _shapes(cfg)[module]
            p = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}."
            tensors[p + "lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(np.float32)
            tensors[p + "lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * std).astype(np.float32)
    save_file(tensors, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "use_rslora": use_rslora,
        "bias": "none",
        "modules_to_save": None,
        **(extra_config or {}),
    }
    (dst / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return dst


def merged_weights(weights: dict, adapter_dir) -> dict:
    """``weights`` (HF name -> array) with the adapter at ``adapter_dir`` merged: each targeted
    ``model.layers.{L}.{block}.{module}.weight`` becomes float64 ``W + scale * B @ A`` (``scale``:
    ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``); the others are returned as
    given."""
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = dict(weights)
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        base = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = np.asarray(weights[base], np.float64)
        out[base] = w + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return out
