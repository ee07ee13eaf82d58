"""GGUF files loaded directly, their Q8_0/Q4_0/Q4_1 tensors kept in blocks: the shipped Q4_1 default
model against the recorded HF reference, and GGUF files written here with the ``gguf`` package against
their own dequantized float32 conversion."""

import json

import pytest

pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)

import gguf
import numpy as np

from rawpaged import LLM, SamplingParams
from rawpaged import weights as W
from rawpaged.kernels.quantization import QuantizedTensor
from rawpaged.model_executor.gguf_loader import LAYER_NAMES, load_gguf, open_reader, read_metadata
from tests.test_weights import TOKENS, gguf_writer, llama_cpp_permute

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)  # as the reference was recorded


def test_shipped_q4_1_gguf_natively_matches_hf_reference(reference_greedy):
    """The default model's own file: Q4_1 linears and a Q8_0 embedding / tied head computed on their
    blocks give the recorded HF ids (the float32 model is exactly this file dequantized)."""
    llm = LLM(model=str(W.default_gguf_path(progress=False)), device="cpu", num_kv_blocks=256, max_model_len=1024)
    model = llm.engine.model
    assert model.layers[0]["qkv_proj"].qtype == "Q4_1" and not isinstance(model.layers[0]["qkv_proj"], np.ndarray)
    assert model.embed_tokens.qtype == "Q8_0"
    assert model.lm_head is model.embed_tokens, "the tied head is the embedding table's blocks"
    refs = reference_greedy["prompts"]
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in refs], GREEDY)
    for ref, out in zip(refs, outs):
        assert out.outputs[0].token_ids == ref["output_token_ids"], ref["name"]
    alone = llm.generate({"prompt_token_ids": refs[0]["prompt_token_ids"]}, GREEDY)[0]
    assert alone.outputs[0].token_ids == refs[0]["output_token_ids"]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0].outputs[0]
    assert chat.text == "The capital of France is Paris."
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]


HIDDEN, N_HEAD, HEAD_DIM, FFN = 64, 2, 32, 96
N_KV, N_LAYERS = 1, 2  # as tests.test_weights' writer sets them


def _write_gguf(path, qtype, seed=0, arch="llama", hidden=HIDDEN, n_head=N_HEAD, ffn=FFN, rope_keys=None):
    """A tiny Llama (Q/K rows permuted as llama.cpp does) or Qwen2 (q/k/v biases, not permuted) GGUF with
    every 2-D tensor in ``qtype`` (head_dim = hidden / n_head); ``rope_keys``: extra ``{arch}.rope.*``
    metadata, key suffix -> value (``{"scaling.type": "linear", "scaling.factor": 4.0}``)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_head
    w = gguf_writer(path, arch, hidden=hidden, ffn=ffn, n_head=n_head, ctx=256, theta=10000.0)
    for key, value in (rope_keys or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(f"{arch}.rope.{key}", value)
    inv = {v: k for k, v in LAYER_NAMES.items()}

    def add(name, arr):
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 2:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype])
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", rng.standard_normal((len(TOKENS), hidden)))
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    shapes = {
        "self_attn.q_proj": (n_head * head_dim, hidden),
        "self_attn.k_proj": (N_KV * head_dim, hidden),
        "self_attn.v_proj": (N_KV * head_dim, hidden),
        "self_attn.o_proj": (hidden, n_head * head_dim),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    for i in range(N_LAYERS):
        for kind, shape in shapes.items():
            arr = rng.standard_normal(shape) * 0.3
            if arch == "llama" and kind == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, n_head)
            elif arch == "llama" and kind == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, N_KV)
            add(f"blk.{i}.{inv[kind]}.weight", arr)
            if arch == "qwen2" and kind in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                add(f"blk.{i}.{inv[kind]}.bias", rng.standard_normal(shape[0]) * 0.3)
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype,arch", [("Q8_0", "llama"), ("Q4_0", "llama"), ("Q4_1", "llama"), ("Q4_1", "qwen2")])
def test_written_gguf_matches_its_dequantized_float32_model(tmp_path, qtype, arch):
    path = _write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, arch=arch)
    hf = W.convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    prompts = [{"prompt_token_ids": [1, 3, 4, 5, 5, 6] * k} for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    native = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256)
    assert native.engine.model.layers[1]["gate_up_proj"].qtype == qtype
    assert (native.engine.model.layers[0]["qkv_bias"] is not None) == (arch == "qwen2")
    dense = LLM(model=str(hf), device="cpu", num_kv_blocks=64, max_model_len=256)
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
    assert got == want
    first = native.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0]
    ref = dense.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0]
    for tid, lp in ref.outputs[0].logprobs[0].items():
        assert first.outputs[0].logprobs[0][tid] == pytest.approx(lp, abs=1e-4)


ROPE_KEYS = {
    "linear": ({"scaling.type": "linear", "scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    # llama.cpp's default type is linear, and it reads the older key when the new one is absent
    "old_key": ({"scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    "factor_1": ({"scaling.type": "linear", "scaling.factor": 1.0}, None),
    "none": ({"scaling.type": "none"}, None),
}


@pytest.mark.parametrize("case", sorted(ROPE_KEYS))
def test_gguf_linear_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path, case):
    keys, want = ROPE_KEYS[case]
    path = _write_gguf(tmp_path / "rope.gguf", "Q8_0", rope_keys=keys)
    config = read_metadata(open_reader(path), str(path))[0]
    assert config["rope_scaling"] == want
    rope = load_gguf(path)[0].rope
    assert (rope.rope_type, rope.factor) == (want["rope_type"], want["factor"]) if want else rope.rope_type == "default"


def test_gguf_linear_rope_scaling_computes_the_float64_reference(tmp_path):
    """A factor-4 linear GGUF: greedy ids equal the float64 reference with ``rope_scaling`` linear 4 on
    the file's dequantized weights, and differ from the same weights unscaled (the factor is used)."""
    from safetensors.numpy import load_file

    from tests.model_reference import decisive_prefix, greedy_reference

    path = _write_gguf(
        tmp_path / "rope.gguf", "Q8_0", seed=3, rope_keys={"scaling.type": "linear", "scaling.factor": 4.0}
    )
    hf = W.convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    cfg = json.loads((hf / "config.json").read_text())
    weights = {k: v.astype(np.float64) for k, v in load_file(hf / "model.safetensors").items()}
    prompt = [1, 3, 4, 5, 5, 6] * 12  # 72 positions: far enough for the factor to move the angles
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    got = got[0].outputs[0].token_ids
    scaled = {**cfg, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    ids, margins = greedy_reference(scaled, weights, prompt, 12, len(prompt) + 12)
    k = decisive_prefix(ids, margins, 1e-3)
    assert k >= 4 and got[:k] == ids[:k]
    plain = greedy_reference({**cfg, "rope_scaling": None}, weights, prompt, 12, len(prompt) + 12)[0]
    assert plain != ids, "pick a seed whose unscaled greedy differs, or the test cannot fail"


@pytest.mark.parametrize(
    "keys,match",
    [
        ({"scaling.type": "yarn", "scaling.factor": 4.0}, "llama.rope.scaling.type 'yarn' is not supported"),
        ({"scaling.type": "none", "scaling.factor": 2.0}, "llama.rope.scaling.factor 2.0 beside"),
        ({"scaling.type": "linear", "scaling.factor": -1.0}, "needs a positive llama.rope.scaling.factor"),
        ({"scaling.type": "linear"}, "needs a positive llama.rope.scale_linear, got None"),
    ],
)
def test_gguf_rope_scaling_it_cannot_compute_is_refused_by_key(tmp_path, keys, match):
    path = _write_gguf(tmp_path / "rope.gguf", "Q8_0", rope_keys=keys)
    with pytest.raises(ValueError, match=match):
        load_gguf(path)


def test_q8_0_on_load_of_a_safetensors_checkpoint(tmp_path, tiny_dir):
    from tests.model_reference import ROPES, decisive_prefix, greedy_reference, write_checkpoint

    cfg, w = write_checkpoint(tmp_path / "m", "qwen2", ROPES["default"])
    llm = LLM(model=str(tmp_path / "m"), device="cpu", num_kv_blocks=64, quantization="q8_0")
    layer = llm.engine.model.layers[0]
    assert layer["qkv_proj"].qtype == "Q8_0" and isinstance(layer["qkv_bias"], np.ndarray)
    # the reference on the Q8_0-rounded weights
    rounded = {
        n: QuantizedTensor.quantize(a, "Q8_0").dequantize().astype(np.float64) if a.ndim == 2 else a
        for n, a in w.items()
    }
    prompt = [5, 9, 14, 200, 31, 7, 7, 80]
    ids, margins = greedy_reference(cfg, rounded, prompt, 8, llm.engine.max_model_len)
    k = decisive_prefix(ids, margins)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert k >= 6 and list(out[0].outputs[0].token_ids)[:k] == ids[:k]
    with pytest.raises(ValueError, match="'gguf' keeps a GGUF file's formats"):
        LLM(model=str(tiny_dir), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=str(tiny_dir), device="cpu", quantization="q4_k")


def test_unsupported_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        LLM(model=str(path), device="cpu")
    with pytest.raises(ValueError, match="model file '.*missing.gguf' does not exist"):
        LLM(model=str(tmp_path / "missing.gguf"), device="cpu")
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="no config.json \\(it holds model.gguf: pass that file as the model\\)"):
        LLM(model=str(holder), device="cpu")
    from rawpaged.config import EngineConfig
    from rawpaged.entrypoints.api_server import model_name_of

    assert model_name_of(EngineConfig(model=str(path))) == "x"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(model=str(bad), device="cpu")


def test_f32_gguf_copy_holds_the_dequantized_weights_and_every_key(tmp_path):
    """``write_f32_gguf`` (llama.cpp's float32 peer in the benchmarks): same keys and names, F32 data equal
    to the ``gguf`` package's dequantization; loading it owns its arrays (no view keeps the file mapped)."""
    src = _write_gguf(tmp_path / "q.gguf", "Q4_1")
    dst = W.write_f32_gguf(src, tmp_path / "f32.gguf")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert [f for f in a.fields if not f.startswith("GGUF.")] == [f for f in b.fields if not f.startswith("GGUF.")]
    for name, f in a.fields.items():
        if not name.startswith("GGUF."):
            assert b.fields[name].contents() == f.contents(), name
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(gguf.quants.dequantize(ta.data, ta.tensor_type), np.asarray(tb.data))
    _, _, dense = load_gguf(dst)
    _, _, native = load_gguf(src, native=False)
    assert dense.keys() == native.keys()
    for name, arr in dense.items():
        assert arr.flags.owndata and arr.dtype == np.float32, name
        np.testing.assert_array_equal(arr, native[name])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        W.write_f32_gguf(tmp_path / "f32.gguf.missing", tmp_path / "x.gguf")


#: a K-quant mix as llama-quantize's Q4_K_M writes them (formats differ inside fused QKV and gate/up, and
#: between layers), on a model whose rows are multiples of 256 so every projection can be a K type
K_MIX = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
     "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
     "ffn_up": "Q5_K", "ffn_down": "Q4_K"},
]  # fmt: skip
K_HIDDEN, K_HEADS, K_FFN = 256, 4, 512


def _write_kquant_gguf(path, seed=0):
    """A tiny Llama GGUF in the ``K_MIX`` formats (embedding and tied head Q6_K): random super-blocks
    written as raw bytes (the ``gguf`` package cannot quantize K types), Q/K rows permuted as llama.cpp
    does; returns the file's tensor bytes."""
    from rawpaged.testing.quant_blocks import random_blocks

    rng = np.random.default_rng(seed)
    head_dim = K_HIDDEN // K_HEADS
    w = gguf_writer(path, "llama", hidden=K_HIDDEN, ffn=K_FFN, n_head=K_HEADS, ctx=256, theta=10000.0)
    shapes = {
        "attn_q": (K_HEADS * head_dim, K_HIDDEN),
        "attn_k": (N_KV * head_dim, K_HIDDEN),
        "attn_v": (N_KV * head_dim, K_HIDDEN),
        "attn_output": (K_HIDDEN, K_HEADS * head_dim),
        "ffn_gate": (K_FFN, K_HIDDEN),
        "ffn_up": (K_FFN, K_HIDDEN),
        "ffn_down": (K_HIDDEN, K_FFN),
    }
    total = 0

    def add(name, qtype, shape, scale):
        nonlocal total
        if qtype == "Q8_0":
            dense = (scale * rng.standard_normal(shape)).astype(np.float32)
            data = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
        else:
            data = random_blocks(qtype, *shape, rng, scale)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, K_HEADS if "attn_q" in name else N_KV)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        total += data.nbytes

    add("token_embd.weight", "Q6_K", (len(TOKENS), K_HIDDEN), 1.0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(K_HIDDEN)).astype(np.float32))
    for i, mix in enumerate(K_MIX):
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", mix[kind], shape, 0.08)
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(K_HIDDEN)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(K_HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def test_kquant_mix_computes_on_its_blocks_and_matches_its_dequantized_float32_model(tmp_path):
    """Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 (and Q8_0) in one model, mixed inside fused projections: no float32 copy of
    any weight (bytes resident within 3% of the file's tensor bytes: the K types' 6-bit scales decoded to
    bytes), and greedy ids equal to the same file dequantized to float32 by the ``gguf`` package, with the
    one-call decode step and op by op, batched and one prompt at a time; logprobs equal between the two
    steps, and the float32 model's top 3 within the 16-bit rounding of the decode products' activations."""
    path = tmp_path / "kmix.gguf"
    file_bytes = _write_kquant_gguf(path)
    hf = W.convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    native = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256)
    model = native.engine.model
    assert model.layers[0]["qkv_proj"].qtype == "Q4_K+Q6_K"
    assert model.layers[1]["qkv_proj"].qtype == "Q5_0+Q5_1+Q8_0"
    assert model.layers[1]["gate_up_proj"].qtype == "Q5_K" and model.layers[0]["down_proj"].qtype == "Q6_K"
    assert model.embed_tokens.qtype == "Q6_K" and model.lm_head is model.embed_tokens
    from rawpaged.testing.quant_blocks import weight_bytes

    resident, dense = weight_bytes(model)
    assert dense == [], f"float32 copies of 2-D weights: {dense}"
    assert file_bytes <= resident <= 1.03 * file_bytes + 4 * K_HIDDEN * 8, (resident, file_bytes)
    assert native.engine.runner.fused_decode.supported, "the mix runs in the one-call decode step"
    op_by_op = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256, fused_decode=False)
    dense_llm = LLM(model=str(hf), device="cpu", num_kv_blocks=64, max_model_len=256)
    prompts = [{"prompt_token_ids": [1, 3, 4, 5, 5, 6] * k} for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in dense_llm.generate(prompts, params)]
    for llm in (native, op_by_op):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert [native.generate(p, params)[0].outputs[0].token_ids for p in prompts] == want  # batch-1 decode
    two = SamplingParams(temperature=0.0, max_tokens=2, logprobs=3)
    fused, stepped, ref = (llm.generate(prompts[:1], two)[0].outputs[0] for llm in (native, op_by_op, dense_llm))
    assert fused.logprobs == stepped.logprobs
    for tid, lp in ref.logprobs[1].items():  # the second token: a decode step
        assert fused.logprobs[1][tid] == pytest.approx(lp, rel=1e-3, abs=1e-3)
