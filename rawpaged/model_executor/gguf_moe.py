"""Mixtures of experts in GGUF files: llama.cpp's ``qwen2moe`` and ``qwen3moe`` architectures, and Mixtral
(architecture ``llama`` with ``llama.expert_count``): their metadata as HF config fields, their tensor
names, and the checks a file must pass.

What llama.cpp writes and assumes (``convert_hf_to_gguf.py``'s ``conversion/qwen.py`` and ``llama.py``,
``src/models/{qwen2moe,qwen3moe,llama}.cpp``):

- ``{arch}.expert_count`` (HF ``num_experts``; Mixtral's ``num_local_experts``),
  ``{arch}.expert_used_count`` (``num_experts_per_tok``), ``{arch}.expert_feed_forward_length``
  (``moe_intermediate_size``; Mixtral's experts are ``feed_forward_length`` wide) and
  ``{arch}.expert_shared_feed_forward_length`` (Qwen2-MoE's ``shared_expert_intermediate_size``; when
  absent llama.cpp takes ``feed_forward_length``).
- No key for ``norm_topk_prob``: the graphs hard-code it, false for ``qwen2moe`` and true for ``qwen3moe``
  (Mixtral's softmax over the selected logits is normalized by construction).
- No keys for ``decoder_sparse_step`` or ``mlp_only_layers``: llama.cpp's graphs make every layer sparse.
  This loader reads a layer that holds a dense ``ffn_{gate,up,down}`` and no expert tensor as dense
  (``mlp_only_layers``, with ``decoder_sparse_step`` 1).
- The experts are stacked per layer: ``blk.N.ffn_{gate,up}_exps`` of ggml ne ``[hidden, I, E]`` and
  ``ffn_down_exps`` of ne ``[I, hidden, E]``; GGUF lists dimensions fastest first, so as numpy they are
  ``[E, I, hidden]`` and ``[E, hidden, I]``, the stacks of HF's ``[out, in]`` weights the model reads
  (``LAYER_NAMES``). The router ``ffn_gate_inp`` is ``[E, hidden]``; Qwen2-MoE's shared expert gate
  ``ffn_gate_inp_shexp`` is ne ``[hidden]`` (read as HF's ``[1, hidden]``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: GGUF architecture -> (HF architecture, HF model_type)
MOE_ARCHITECTURES = {"qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
#: HF model_type -> the GGUF architecture whose layer names it uses
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
#: GGUF layer tensor (without ``blk.N.`` and the suffix) -> the name the model reads (the stacks
#: ``[E, rows, cols]``, ``rawpaged.kernels.quantization.QuantizedExperts`` or float arrays)
LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
#: the HF config fields ``moe_config`` gives (besides ``architectures`` and ``model_type``)
MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
#: the tensors every sparse layer holds, and Qwen2-MoE's besides (its shared expert)
SPARSE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_TENSORS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")
#: llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX``, the only router these architectures use
_GATING_SOFTMAX = 1
_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def is_moe(arch: str, get: Callable[[str, Any], Any]) -> bool:
    """Whether a file of GGUF architecture ``arch`` (metadata through ``get(key, default)``) is a mixture
    of experts this loader reads."""
    return arch in MOE_ARCHITECTURES or (arch == "llama" and bool(get("llama.expert_count", 0)))


def sparse_layers(names: set, n_layers: int) -> list:
    """Per layer, whether it is sparse: it holds an expert or router tensor, or no dense FFN."""
    return [
        any(f"blk.{i}.{k}.weight" in names for k in SPARSE_TENSORS) or f"blk.{i}.ffn_up.weight" not in names
        for i in range(n_layers)
    ]


def moe_config(arch: str, get: Callable[[str, Any], Any], n_layers: int, names: set, source: str) -> dict:
    """The HF config fields of a mixture-of-experts GGUF (``architectures`` and ``model_type`` too; module
    docstring).

    Raises ValueError naming the file and the key: a missing expert count, more experts used than there
    are, per-layer expert widths that differ, a router other than softmax, expert groups or a weights
    scale, or a Mixtral layer without experts."""

    def need(key):
        value = get(f"{arch}.{key}", None)
        if value is None:
            raise ValueError(f"{source}: missing metadata {arch}.{key}")
        return value

    experts, used = int(need("expert_count")), int(need("expert_used_count"))
    if used > experts:
        raise ValueError(f"{source}: {arch}.expert_used_count {used} is greater than {arch}.expert_count {experts}")
    _refuse_other_routers(arch, get, source)
    sparse = sparse_layers(names, n_layers)
    if arch == "llama":
        if not all(sparse):
            raise ValueError(f"{source}: Mixtral layers {[i for i, s in enumerate(sparse) if not s]} have no experts")
        return {"architectures": [MIXTRAL[0]], "model_type": MIXTRAL[1], "num_local_experts": experts,
                "num_experts_per_tok": used, "sliding_window": None}  # fmt: skip
    ffn = int(need("feed_forward_length"))
    width = get(f"{arch}.expert_feed_forward_length", None)
    widths = set(width) if isinstance(width, list) else {width if width is not None else ffn // used}
    if len(widths) != 1:
        raise ValueError(f"{source}: {arch}.expert_feed_forward_length differs between layers: {width}")
    hf_arch, model_type = MOE_ARCHITECTURES[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(widths.pop()),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, s in enumerate(sparse) if not s],
    }
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(get(f"{arch}.expert_shared_feed_forward_length", ffn))
    return config


def _refuse_other_routers(arch: str, get: Callable[[str, Any], Any], source: str) -> None:
    """ValueError naming the key of a router these architectures do not have (sigmoid scores, expert
    groups, scaled weights): nothing is computed wrongly in silence."""
    gating = get(f"{arch}.expert_gating_func", None)
    if gating not in (None, _GATING_SOFTMAX):
        raise ValueError(f"{source}: {arch}.expert_gating_func {gating!r} is not supported (only softmax)")
    groups = get(f"{arch}.expert_group_count", None)
    if groups not in (None, 0, 1):
        raise ValueError(f"{source}: {arch}.expert_group_count {groups!r} is not supported (grouped top-k)")
    scale = get(f"{arch}.expert_weights_scale", None)
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"{source}: {arch}.expert_weights_scale {scale!r} is not supported")


def check_moe_tensors(names: set, config: dict, source: str) -> None:
    """ValueError naming the file and the first GGUF tensor a sparse layer lacks (the router, an expert
    stack, Qwen2-MoE's shared expert), or per-expert tensors of llama.cpp's older Mixtral layout."""
    old = sorted(n for n in names if _PER_EXPERT.fullmatch(n))
    if old:
        raise ValueError(
            f"{source}: per-expert tensors ({old[0]}, ...) of llama.cpp's older Mixtral layout are not supported; "
            "convert the model again (the stacked ffn_*_exps tensors)"
        )
    dense = set(config.get("mlp_only_layers", ()))
    wanted = SPARSE_TENSORS + (SHARED_TENSORS if config.get("shared_expert_intermediate_size") else ())
    for i in range(int(config["num_hidden_layers"])):
        if i in dense:
            continue
        for kind in wanted:
            if f"blk.{i}.{kind}.weight" not in names:
                raise ValueError(f"{source}: missing tensor blk.{i}.{kind}.weight (layer {i} is a sparse MoE layer)")


def expected_shapes(model_config) -> dict:
    """``model_config.expected_shapes()`` with each sparse layer's router and experts under the names a
    GGUF gives them (the stacks, where a HF checkpoint has one tensor per expert)."""
    shapes = dict(model_config.expected_shapes())
    for i, sparse in enumerate(getattr(model_config, "moe_layers", ())):
        if not sparse:
            continue
        p = f"model.layers.{i}."
        for name in [n for n in shapes if n.startswith((p + "block_sparse_moe.", p + "mlp.experts.", p + "mlp.gate."))]:
            del shapes[name]
        E, H, F = model_config.num_experts, model_config.hidden_size, model_config.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = (E, H)
        shapes[p + "mlp.experts.gate_proj.weight"] = (E, F, H)
        shapes[p + "mlp.experts.up_proj.weight"] = (E, F, H)
        shapes[p + "mlp.experts.down_proj.weight"] = (E, H, F)
    return shapes
