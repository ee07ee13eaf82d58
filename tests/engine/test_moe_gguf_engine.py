"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end from GGUF: a random checkpoint (``random_model``), its F32
GGUF (``write_moe_gguf``), its Q8_0 experts and llama.cpp's Q4_K_M of it (``llama_quantize``), each
loaded by the engine. The F32 GGUF gives the safetensors checkpoint's greedy tokens; a quantized file's
teacher-forced logits match the float64 reference (``tests/moe_reference.py``) on that file's own
weights as the ``gguf`` package dequantizes them (read here without rawpaged's loader), and its batched
greedy tokens equal its one-at-a-time ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf

from rawpaged import LLM, SamplingParams
from rawpaged.testing.random_model import MOE_Q8_SHAPES, MOE_SHAPES, write_random_model
from rawpaged.testing.random_moe_gguf import find_llama_quantize, llama_quantize, write_moe_gguf
from tests.model_executor.test_moe import PROMPTS, STD, _teacher_forced
from tests.moe_reference import forward

ARCHS = list(MOE_SHAPES)
#: widths of 256 (K-quant super-blocks): llama-quantize's Q4_K_M takes Q4_K and Q6_K for them
K_SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_heads=4, num_kv_heads=2,
               head_dim=64, num_experts=4)  # fmt: skip
K_SHAPES = {a: dict(MOE_SHAPES[a], **K_SHAPE, shared_expert_intermediate_size=256) for a in ARCHS}
K_SHAPES["MixtralForCausalLM"].pop("moe_intermediate_size")
K_SHAPES["Qwen3MoeForCausalLM"].pop("shared_expert_intermediate_size")
K_SHAPES["MixtralForCausalLM"].pop("shared_expert_intermediate_size")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IDS = PROMPTS[4] + PROMPTS[2][:4]  # 41 tokens: _teacher_forced's chunks


def _greedy(path, prompts):
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    out = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return out


# ------------------------------------------------------------------------------------------ the file's weights
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: expert stack -> (Qwen's, Mixtral's) per-expert name
_EXPERTS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3")}
_EXPERTS["ffn_down_exps"] = ("down_proj", "w2")


def file_weights(path, cfg: dict) -> dict:
    """The GGUF ``path``'s tensors dequantized by the ``gguf`` package, under the HF checkpoint's names
    (per expert, Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``; Q/K rows un-permuted as llama.cpp's
    converter permuted Mixtral's)."""
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
        parts = t.name.split(".")
        if parts[0] != "blk":
            out[f"{_GLOBAL[parts[0]]}.{parts[1]}"] = w
            continue
        p, kind, suffix = f"model.layers.{parts[1]}.", parts[2], parts[3]
        if mixtral and kind in heads and suffix == "weight":  # inverse of LlamaModel.permute
            n = heads[kind]
            w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        block = p + ("block_sparse_moe." if mixtral else "mlp.")
        if kind in _EXPERTS:
            for e in range(w.shape[0]):
                out[block + f"experts.{e}.{_EXPERTS[kind][mixtral]}.weight"] = w[e]
        elif kind == "ffn_gate_inp":
            out[block + "gate.weight"] = w
        else:
            out[p + f"{_LAYER[kind]}.{suffix}"] = w.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else w
    return out


# ------------------------------------------------------------------------------------------ F32: the same model
@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_and_f32_gguf_give_the_same_tokens(tmp_path, arch):
    """The same random model from safetensors and from its F32 GGUF: the same greedy tokens, and the
    same teacher-forced logits within float32 rounding (the GGUF's Q/K rows permuted and back)."""
    hf = write_random_model(tmp_path / "hf", weight_std=STD, **MOE_SHAPES[arch])
    path = write_moe_gguf(hf, tmp_path / "f32.gguf")
    want = _greedy(hf, PROMPTS)
    assert len({tuple(t) for t in want}) > 1
    assert _greedy(path, PROMPTS) == want
    got, ref = _teacher_forced(path, IDS), _teacher_forced(hf, IDS)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ quantized files
def _check_quantized(path, hf, rel_tol):
    """Teacher-forced logits of the file within ``rel_tol`` of its largest reference logit; batched
    greedy == one at a time. Returns the relative error (printed for the record)."""
    cfg = json.loads((hf / "config.json").read_text())
    want = forward(cfg, file_weights(path, cfg), IDS)
    got = _teacher_forced(path, IDS)
    scale = np.abs(want).max()
    assert scale > 0.3, "logits too flat to compare"
    rel = np.abs(got - want).max() / scale
    print(f"{path.name} {cfg['architectures'][0]}: max |delta| / max |logit| {rel:.2e} (max |logit| {scale:.2f})")
    assert rel < rel_tol
    one = [_greedy(path, [p])[0] for p in PROMPTS]
    assert _greedy(path, PROMPTS) == one
    return rel


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_matches_the_reference_on_its_dequantized_weights(tmp_path, arch):
    """Q8_0 experts (the rest F32; float32 products on the dequantized rows): within 1e-5 of the largest
    logit (measured 5e-7)."""
    hf = write_random_model(tmp_path / "hf", weight_std=STD, **MOE_Q8_SHAPES[arch])
    _check_quantized(write_moe_gguf(hf, tmp_path / "q8_0.gguf", expert_type="Q8_0"), hf, 1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_q4_k_m_gguf_matches_the_reference_on_its_dequantized_weights(tmp_path, arch):
    """llama-quantize's Q4_K_M of the F32 file (Q4_K/Q6_K experts, attention and embeddings): the
    sub-block formats' integer dot products round the activations to int16, so within 2e-3 of the
    largest logit (measured 2e-4 to 4e-4)."""
    if find_llama_quantize() is None:
        pytest.skip("no llama-quantize (scripts/q4_k_m_check.py builds one; or set RAWPAGED_LLAMA_QUANTIZE)")
    hf = write_random_model(tmp_path / "hf", weight_std=STD, **K_SHAPES[arch])
    path = llama_quantize(write_moe_gguf(hf, tmp_path / "f32.gguf"), tmp_path / "q4_k_m.gguf", "Q4_K_M")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name}
    assert "Q4_K" in types
    _check_quantized(path, hf, 2e-3)


# ------------------------------------------------------------------------------------------ unread experts
def _fill_expert(path, layer: int, expert: int, byte: int) -> None:
    """Overwrite expert ``expert``'s bytes in layer ``layer``'s three stacks of the GGUF ``path`` with
    ``byte``: 0x00 makes the expert's weights zero; 0xFF sets every block's fp16 scale bits to 0xFFFF (Q8_0's
    and Q4_K's first two bytes, Q6_K's last two), NaN to the ``gguf`` package but +-131008 to the CPU
    kernels' ``intrinsics.half_to_float`` (no Inf/NaN case), so weights about 1e5 that no read could hide."""
    stacks = {f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if t.name in stacks]
    assert len(tensors) == 3 and all(t.tensor_type.name != "F32" for t in tensors)
    with open(path, "r+b") as f:
        for t in tensors:
            per_expert = t.n_bytes // int(t.shape[-1])
            f.seek(t.data_offset + expert * per_expert)
            f.write(bytes([byte]) * per_expert)


def _unreachable_expert_checkpoint(dst, shape):
    """A Mixtral of 5 experts, top 2, whose layer-0 router can never pick expert 4 (rows u, -u, v, -v, 0:
    two of the first four logits are >= 0, expert 4's, and the last expert loses ties)."""
    from safetensors.numpy import load_file, save_file

    hf = write_random_model(dst, weight_std=STD, **dict(shape, num_experts=5))
    tensors = load_file(str(hf / "model.safetensors"))
    router = tensors["model.layers.0.block_sparse_moe.gate.weight"]
    router[1], router[3], router[4] = -router[0], -router[2], 0.0
    save_file(tensors, str(hf / "model.safetensors"))
    return hf


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_a_quantized_expert_no_token_selects_is_never_read(tmp_path, ftype):
    """The unreachable expert's blocks all 0xFF bytes in one copy of the file and zero in another
    (``_fill_expert``): the engine's teacher-forced logits (prefill and decode) are finite and equal bit
    for bit, and so are the greedy tokens of a batch. (Poisoning reachable expert 0 instead fails.)"""
    if ftype == "Q8_0":
        hf = _unreachable_expert_checkpoint(tmp_path / "hf", MOE_Q8_SHAPES["MixtralForCausalLM"])
        src = write_moe_gguf(hf, tmp_path / "src.gguf", expert_type="Q8_0")
    else:
        if find_llama_quantize() is None:
            pytest.skip("no llama-quantize (scripts/q4_k_m_check.py builds one; or set RAWPAGED_LLAMA_QUANTIZE)")
        hf = _unreachable_expert_checkpoint(tmp_path / "hf", K_SHAPES["MixtralForCausalLM"])
        src = llama_quantize(write_moe_gguf(hf, tmp_path / "f32.gguf"), tmp_path / "src.gguf", ftype)
    files = []
    for name, byte in (("poisoned", 0xFF), ("clean", 0x00)):
        files.append(tmp_path / f"{name}.gguf")
        files[-1].write_bytes(src.read_bytes())
        _fill_expert(files[-1], 0, 4, byte)
    chunks = ((30, False), (1, True), (5, False), (1, True))
    got, want = (_teacher_forced(f, PROMPTS[4], chunks) for f in files)
    assert np.isfinite(got).all() and np.array_equal(got, want)
    assert _greedy(files[0], PROMPTS) == _greedy(files[1], PROMPTS)
