"""GGUF files of random mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE HF directories, as
``random_model`` writes them), laid out as llama.cpp's converter lays them out, for tests and benchmarks.

``write_moe_gguf(hf_dir, dst, expert_type)`` writes the ``gguf`` package's GGUF of an HF directory: the
architectures ``llama`` (Mixtral, with ``llama.expert_count``; Q/K rows permuted as the converter does),
``qwen2moe`` and ``qwen3moe`` (and a dense ``LlamaForCausalLM`` as ``llama``: the dense counterpart
``benchmarks/moe.py`` times a mixture against); each sparse layer's per-expert tensors stacked into
``ffn_{gate,up,down}_exps`` (numpy ``[E, rows, cols]``, ggml ne ``[cols, rows, E]``), the router as
``ffn_gate_inp`` and Qwen2-MoE's shared expert as ``ffn_*_shexp`` (``conversion/qwen.py``,
``conversion/llama.py``). The experts are F32 or Q8_0 (the ``gguf`` package's quantizer), every other tensor
F32. K-quant experts come from llama.cpp's ``llama-quantize`` on the F32 file (``llama_quantize``): the
``gguf`` package cannot write K-quants.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

from rawpaged.errors import import_optional

#: HF architecture -> GGUF architecture
GGUF_ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}
GGUF_ARCH["LlamaForCausalLM"] = "llama"  # dense: no expert keys or stacks
#: HF layer tensor (without ``model.layers.N.`` and ``.weight``/``.bias``) -> GGUF's (without ``blk.N.``)
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"
#: the per-expert projection names of each layout -> the stack's GGUF name
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_EXPERT.update({"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"})
#: where the sdist build of ``scripts/q4_k_m_check.py`` leaves llama.cpp's tools (``RAWPAGED_LLAMA_QUANTIZE``
#: names another binary)
LLAMA_QUANTIZE_ENV = "RAWPAGED_LLAMA_QUANTIZE"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_checkpoint(hf_dir: Path) -> dict:
    safetensors = import_optional("safetensors", "reading a checkpoint").numpy
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(safetensors.load_file(str(f)))
    return tensors


def _stack_experts(tensors: dict) -> dict:
    """GGUF name -> array of the checkpoint's per-expert tensors, stacked per layer and projection."""
    stacks: dict = {}
    for name in list(tensors):
        parts = name.split(".")
        if "experts" not in parts or parts[-1] != "weight":
            continue
        layer, e, proj = int(parts[2]), int(parts[parts.index("experts") + 1]), parts[-2]
        stacks.setdefault(f"blk.{layer}.{_EXPERT[proj]}.weight", {})[e] = tensors.pop(name)
    return {n: np.stack([by_e[e] for e in sorted(by_e)]) for n, by_e in stacks.items()}


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    base, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[base]}.{suffix}"


def _add_metadata(w, cfg: dict, arch: str, hf_dir: Path) -> None:
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_key_length(cfg.get("head_dim") or H // heads)
    w.add_value_length(cfg.get("head_dim") or H // heads)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["architectures"][0] != "LlamaForCausalLM":
        w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _add_tokenizer(w, cfg, hf_dir)


def _add_tokenizer(w, cfg: dict, hf_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as ``tokenizer.ggml.*`` (pre-tokenizer ``smollm``)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_add_bos_token(False)
    tc = hf_dir / "tokenizer_config.json"
    template = json.loads(tc.read_text()).get("chat_template") if tc.is_file() else None
    if template:
        w.add_chat_template(template)


def _refuse_what_gguf_cannot_say(cfg: dict, arch: str, hf_dir: Path) -> None:
    """ValueError naming the config.json field a GGUF has no key for and llama.cpp's graphs fix otherwise:
    ``norm_topk_prob`` (false for qwen2moe, true for qwen3moe) and Mixtral's ``sliding_window`` (none)."""
    if arch != "llama" and bool(cfg.get("norm_topk_prob", False)) != (arch == "qwen3moe"):
        raise ValueError(
            f"{hf_dir}: norm_topk_prob {cfg.get('norm_topk_prob')} cannot be written to a {arch} GGUF "
            f"(llama.cpp's {arch} takes it {arch == 'qwen3moe'})"
        )
    if arch == "llama" and cfg.get("sliding_window"):
        raise ValueError(f"{hf_dir}: sliding_window {cfg['sliding_window']} cannot be written to a Mixtral GGUF")


def write_moe_gguf(hf_dir, dst, expert_type: str = "F32") -> Path:
    """Write the GGUF of the mixture-of-experts HF directory ``hf_dir`` at ``dst`` (module docstring) and
    return it; ``expert_type`` "F32" or "Q8_0" for the expert stacks (their widths multiples of 32).

    Raises ValueError for another architecture or expert type, or a ``norm_topk_prob`` or Mixtral
    ``sliding_window`` the file could not carry (``_refuse_what_gguf_cannot_say``); MissingDependencyError
    without ``gguf``."""
    gguf = import_optional("gguf", "writing a GGUF file")
    hf_dir, dst = Path(hf_dir), Path(dst)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH.get((cfg.get("architectures") or [None])[0])
    if arch is None:
        raise ValueError(f"{hf_dir}: architectures {cfg.get('architectures')} is not one of {sorted(GGUF_ARCH)}")
    if expert_type not in ("F32", "Q8_0"):
        raise ValueError(f"expert_type {expert_type!r}: F32 or Q8_0 (K-quants: llama_quantize)")
    _refuse_what_gguf_cannot_say(cfg, arch, hf_dir)
    tensors = _read_checkpoint(hf_dir)
    stacks = _stack_experts(tensors)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg.get("num_key_value_heads")}
    w = gguf.GGUFWriter(str(dst), arch)
    _add_metadata(w, cfg, arch, hf_dir)
    for name, arr in tensors.items():
        gname = _gguf_name(name)
        arr = np.ascontiguousarray(arr, np.float32)
        kind = gname.split(".")[-2]
        if arch == "llama" and kind in heads and gname.endswith(".weight"):
            arr = llama_cpp_permute(arr, heads[kind] or heads["attn_q"])
        w.add_tensor(gname, arr)
    qtype = gguf.GGMLQuantizationType[expert_type]
    for gname, arr in stacks.items():
        arr = np.ascontiguousarray(arr, np.float32)
        if expert_type == "F32":
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def find_llama_quantize() -> Path | None:
    """llama.cpp's ``llama-quantize``: ``$RAWPAGED_LLAMA_QUANTIZE``, else the build ``scripts/q4_k_m_check.py``
    makes from the llama-cpp-python sdist under ``/tmp/*/llama_cpp_python-*``; None where there is none."""
    env = os.environ.get(LLAMA_QUANTIZE_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    found = sorted(Path("/tmp").glob("*/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-quantize"))
    return found[-1] if found else None


def llama_quantize(src, dst, ftype: str = "Q4_K_M", tool=None, threads: int = 2) -> Path:
    """``dst``: llama.cpp's ``llama-quantize`` of the F32 GGUF ``src`` to ``ftype`` (e.g. Q4_K_M, Q5_K_M,
    Q6_K). Raises FileNotFoundError where there is no ``llama-quantize`` (``find_llama_quantize``), or
    CalledProcessError with its output when it fails."""
    tool = Path(tool) if tool is not None else find_llama_quantize()
    if tool is None or not tool.is_file():
        raise FileNotFoundError(f"no llama-quantize (set {LLAMA_QUANTIZE_ENV})")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tool.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    subprocess.run([str(tool), str(src), str(dst), ftype, str(threads)], check=True, capture_output=True, env=env)
    return Path(dst)
