"""Mixtures of experts in GGUF files (``gguf_moe``, ``gguf_loader``, ``rawpaged.testing.random_moe_gguf``): a
random Mixtral, Qwen2-MoE and Qwen3-MoE checkpoint and its GGUF (F32, Q8_0 and llama-quantize's K-quant
experts) load to the same tensors under the names the model reads, the experts kept in their blocks."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.quantization import NATIVE, QuantizedExperts
from rawpaged.model_executor import gguf_loader, gguf_moe
from rawpaged.testing.random_model import MOE_Q8_SHAPES, write_random_model
from rawpaged.testing.random_moe_gguf import find_llama_quantize, llama_quantize, write_moe_gguf
from tests.moe_reference import sparse_layers

ARCHS = tuple(MOE_Q8_SHAPES)


def write_hf_moe(dst, arch, **kw):
    """``random_model``'s checkpoint of ``arch`` (``MOE_Q8_SHAPES``, keyword arguments overriding them) in
    HF's layout: per-expert tensors (Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``), Qwen2-MoE's
    shared expert and its gate."""
    return write_random_model(dst, weight_std=0.1, **{**MOE_Q8_SHAPES[arch], **kw})


def hf_stacked(hf_dir) -> dict:
    """The checkpoint under the model's names, its experts stacked with ``np.stack`` (as the HF loader
    stacks them), Mixtral's router renamed."""
    t = load_file(str(hf_dir / "model.safetensors"))
    out, stacks = {}, {}
    rename = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, arr in t.items():
        parts = name.split(".")
        if "experts" in parts:
            p = ".".join(parts[:3])
            stacks.setdefault(f"{p}.mlp.experts.{rename.get(parts[-2], parts[-2])}.weight", {})[int(parts[5])] = arr
        else:
            out[name.replace("block_sparse_moe.gate", "mlp.gate")] = arr
    out.update({n: np.stack([by_e[e] for e in sorted(by_e)]) for n, by_e in stacks.items()})
    return out


def read(path):
    reader = gguf_loader.open_reader(path)
    config = gguf_loader.read_metadata(reader, str(path))[0]
    return config, gguf_loader.read_tensors(reader, config, str(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_loads_to_the_hf_checkpoints_tensors(tmp_path, arch):
    hf = write_hf_moe(tmp_path / "hf", arch)
    config, tensors = read(write_moe_gguf(hf, tmp_path / "m.gguf"))
    want = hf_stacked(hf)
    assert set(tensors) == set(want)
    for name, arr in want.items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == arr.shape, name
        np.testing.assert_array_equal(tensors[name], arr, err_msg=name)
    hf_cfg = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == [arch] and config["model_type"] == hf_cfg["model_type"]
    assert sparse_layers(config) == sparse_layers(hf_cfg)  # GGUF: step 1, the dense layers listed
    for key in set(gguf_moe.MOE_FIELDS) - {"decoder_sparse_step", "mlp_only_layers"}:
        if key in hf_cfg:
            assert config[key] == hf_cfg[key], key


def test_a_dense_llama_is_written_as_llama_without_expert_keys(tmp_path):
    """The dense counterpart ``benchmarks/moe.py`` times a mixture against: the same file layout, no expert
    keys or stacks, and the checkpoint's tensors back (Q/K rows unpermuted by the loader)."""
    hf = write_random_model(tmp_path / "hf", weight_std=0.1, **{**MOE_Q8_SHAPES["MixtralForCausalLM"],
                            "architecture": "LlamaForCausalLM"})  # fmt: skip
    path = write_moe_gguf(hf, tmp_path / "m.gguf")
    assert not [f for f in gguf.GGUFReader(str(path)).fields if "expert" in f]
    config, tensors = read(path)
    assert config["architectures"] == ["LlamaForCausalLM"] and not config.get("num_experts")
    want = load_file(str(hf / "model.safetensors"))
    assert set(tensors) == set(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(tensors[name], arr, err_msg=name)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_q8_0_experts_stay_in_their_blocks(tmp_path, arch):
    hf = write_hf_moe(tmp_path / "hf", arch)
    path = write_moe_gguf(hf, tmp_path / "m.gguf", expert_type="Q8_0")
    _, tensors = read(path)
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    want = hf_stacked(hf)
    stacks = [n for n in tensors if ".mlp.experts." in n]
    assert len(stacks) == 3 * sum(sparse_layers(json.loads((hf / "config.json").read_text())))
    for name in stacks:
        q = tensors[name]
        assert isinstance(q, QuantizedExperts) and q.format == "Q8_0" and q.shape == want[name].shape
        layer, proj = name.split(".")[2], name.split(".")[-2].removesuffix("_proj")
        t = raw[f"blk.{layer}.ffn_{proj}_exps.weight"]
        for e in range(q.shape[0]):
            ref = gguf.quants.dequantize(np.asarray(t.data)[e], t.tensor_type)
            np.testing.assert_array_equal(q.expert(e).dequantize(), ref)
        np.testing.assert_allclose(q.dequantize(), want[name], atol=np.abs(want[name]).max() / 127)


def test_kquant_experts_from_llama_quantize(tmp_path):
    """llama-quantize's Q4_K_M of the F32 file: the stacks in their K-quant blocks, each expert as the
    ``gguf`` package dequantizes it, and the grouped product on them as the dense product of each expert."""
    if find_llama_quantize() is None:
        pytest.skip("no llama-quantize (scripts/q4_k_m_check.py builds one; or set RAWPAGED_LLAMA_QUANTIZE)")
    hf = write_hf_moe(tmp_path / "hf", "Qwen3MoeForCausalLM", hidden_size=256, intermediate_size=256,
                      moe_intermediate_size=256, num_experts=4, num_layers=2, decoder_sparse_step=1)  # fmt: skip
    path = llama_quantize(write_moe_gguf(hf, tmp_path / "f32.gguf"), tmp_path / "q4_k_m.gguf", "Q4_K_M")
    _, tensors = read(path)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    want = hf_stacked(hf)
    formats = set()
    for layer in range(2):
        for proj in ("gate", "up", "down"):
            q = tensors[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"]
            assert isinstance(q, QuantizedExperts) and q.format in NATIVE
            formats.add(q.format)
            t = raw[f"blk.{layer}.ffn_{proj}_exps.weight"]
            data = np.asarray(t.data).reshape(q.shape[0], q.shape[1], -1)
            for e in range(q.shape[0]):
                np.testing.assert_array_equal(q.expert(e).dequantize(), gguf.quants.dequantize(data[e], t.tensor_type))
            ref = want[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"]
            assert np.abs(q.dequantize() - ref).max() < 0.1 * np.abs(ref).max()
    assert "Q4_K" in formats
    be = CPUBackend()
    q = tensors["model.layers.0.mlp.experts.gate_proj.weight"]
    x = np.random.default_rng(0).standard_normal((7, 256)).astype(np.float32)
    offsets = np.array([0, 3, 3, 6, 7], np.int64)
    got = be.grouped_linear(x, offsets, be.load_experts([q]))
    deq = q.dequantize().astype(np.float64)
    want_y = np.concatenate([x[offsets[e] : offsets[e + 1]] @ deq[e].T for e in range(4)])
    np.testing.assert_allclose(got, want_y, rtol=1e-3, atol=1e-3 * np.abs(want_y).max())


def test_a_missing_expert_tensor_is_named(tmp_path):
    hf = write_hf_moe(tmp_path / "hf", "Qwen2MoeForCausalLM")
    t = load_file(str(hf / "model.safetensors"))
    save_file(
        {n: a for n, a in t.items() if not n.startswith("model.layers.2.mlp.experts.")}, str(hf / "model.safetensors")
    )
    path = write_moe_gguf(hf, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"missing tensor blk\.2\.ffn_gate_exps\.weight"):
        read(path)


def test_more_experts_used_than_there_are_is_refused(tmp_path):
    hf = write_hf_moe(tmp_path / "hf", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="qwen3moe.expert_used_count 5 is greater than qwen3moe.expert_count 4"):
        read(write_moe_gguf(hf, tmp_path / "m.gguf"))


@pytest.mark.parametrize(
    "arch,kw,match",
    [("Qwen2MoeForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob True"),
     ("Qwen3MoeForCausalLM", dict(norm_topk_prob=False), "norm_topk_prob False"),
     ("MixtralForCausalLM", dict(sliding_window=16), "sliding_window 16")],
)  # fmt: skip
def test_fields_a_gguf_cannot_carry_are_refused_by_the_writer(tmp_path, arch, kw, match):
    """No GGUF key says them and llama.cpp's graphs fix them: a file written anyway would route (or
    attend) differently from its checkpoint."""
    with pytest.raises(ValueError, match=match):
        write_moe_gguf(write_hf_moe(tmp_path / "hf", arch, **kw), tmp_path / "m.gguf")


def test_expected_shapes_take_the_stacks_in_place_of_per_expert_tensors():
    """A model config listing HF's per-expert tensors (as the safetensors loader reads them): a GGUF is
    checked against its stacks instead; dense layers and dense models keep their names."""
    hf_names = {"model.norm.weight": (8,), "model.layers.0.mlp.up_proj.weight": (12, 8)}
    hf_names.update({f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight": (6, 8) for e in range(3)})
    hf_names["model.layers.1.block_sparse_moe.gate.weight"] = (3, 8)
    cfg = SimpleNamespace(expected_shapes=lambda: dict(hf_names), moe_layers=(False, True), num_experts=3,
                          hidden_size=8, moe_intermediate_size=6)  # fmt: skip
    shapes = gguf_moe.expected_shapes(cfg)
    p = "model.layers.1.mlp."
    assert shapes == {
        "model.norm.weight": (8,),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        p + "gate.weight": (3, 8),
        p + "experts.gate_proj.weight": (3, 6, 8),
        p + "experts.up_proj.weight": (3, 6, 8),
        p + "experts.down_proj.weight": (3, 8, 6),
    }
    assert gguf_moe.expected_shapes(SimpleNamespace(expected_shapes=lambda: dict(hf_names))) == hf_names


def test_other_routers_and_the_older_per_expert_layout_are_refused():
    meta = {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.feed_forward_length": 64}
    names = {f"blk.0.{k}.weight" for k in gguf_moe.SPARSE_TENSORS}
    assert gguf_moe.moe_config("qwen3moe", meta.get, 1, names, "f")["norm_topk_prob"] is True
    for key, value in (("expert_gating_func", 2), ("expert_group_count", 8), ("expert_weights_scale", 2.5)):
        with pytest.raises(ValueError, match=f"qwen3moe.{key}"):
            gguf_moe.moe_config("qwen3moe", {**meta, f"qwen3moe.{key}": value}.get, 1, names, "f")
    old = {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate.0.weight", "blk.0.ffn_up.0.weight"}
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate\.0\.weight.*older Mixtral layout"):
        gguf_moe.check_moe_tensors(old, {"num_hidden_layers": 1}, "f")
