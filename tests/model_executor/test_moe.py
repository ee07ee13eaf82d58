"""Mixtral, Qwen2-MoE and Qwen3-MoE from HF safetensors on the CPU backend: config parsing as HF's configs
read it, what is refused, teacher-forced logits against the float64 reference written from HF's modeling
files (``tests/moe_reference.py``), greedy tokens with and without batching, prefix hits and preemption,
and an expert no token selects never being read.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rawpaged import LLM, SamplingParams
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.model_executor.model_loader import load_model
from rawpaged.model_executor.model_parts import build_model
from rawpaged.model_executor.models.llama import AttentionMetadata
from rawpaged.testing.random_model import MOE_SHAPES, write_random_model
from tests.moe_reference import forward

ARCHS = list(MOE_SHAPES)
#: weights N(0, 0.15): peaked routing and attention, logits of order 1 (so the comparison means something)
STD = 0.15
_rng = np.random.default_rng(56)
#: short ones first, so the small pool admits several that then grow (preemption)
PROMPTS = [[int(t) for t in _rng.integers(3, 259, n)] for n in (11, 13, 5, 19, 37)]
PROMPTS.append(PROMPTS[4][:24] + [7, 8, 9])  # shares 6 blocks of 4 with the fifth
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    cache = {}

    def get(arch, num_shards=1):
        key = (arch, num_shards)
        if key not in cache:
            d = write_random_model(root / f"{arch}-{num_shards}", weight_std=STD, num_shards=num_shards,
                                   **MOE_SHAPES[arch])  # fmt: skip
            cfg = json.loads((d / "config.json").read_text())
            w = {}
            for f in sorted(d.glob("*.safetensors")):
                w.update(load_file(str(f)))
            cache[key] = (d, cfg, w)
        return cache[key]

    return get


# ------------------------------------------------------------------------------------------ config
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=4)  # fmt: skip


def _cfg(arch, **kw):
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **kw})


def test_mixtral_defaults_are_hf_s():
    cfg = _cfg("MixtralForCausalLM")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 8)
    assert cfg.moe and cfg.moe_layers == (True,) * 4 and not cfg.moe_softmax_before_topk
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.shared_expert_intermediate_size == 0
    assert _cfg("MixtralForCausalLM", sliding_window=4).layer_windows() == (4,) * 4
    shapes = cfg.expected_shapes()
    assert shapes["model.layers.3.block_sparse_moe.experts.7.w2.weight"] == (16, 8)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes


def test_qwen_moe_defaults_and_layer_kinds():
    q2 = _cfg("Qwen2MoeForCausalLM")
    assert (q2.num_experts, q2.num_experts_per_tok, q2.moe_intermediate_size) == (60, 4, 1408)
    assert q2.shared_expert_intermediate_size == 5632 and q2.attention_bias and not q2.norm_topk_prob
    assert not _cfg("Qwen2MoeForCausalLM", qkv_bias=False).attention_bias
    q3 = _cfg("Qwen3MoeForCausalLM", decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert q3.qk_norm and not q3.attention_bias and q3.norm_topk_prob and q3.moe_softmax_before_topk
    assert q3.moe_layers == (False, True, False, False)  # layers 1 and 3 by the step, 3 dense by the list
    shapes = q3.expected_shapes()
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (8, 16)
    assert shapes["model.layers.1.mlp.experts.127.down_proj.weight"] == (16, 768)
    assert "model.layers.1.mlp.shared_expert_gate.weight" not in shapes
    assert _cfg("Qwen2MoeForCausalLM").expected_shapes()["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 16)
    assert not _cfg("LlamaForCausalLM").moe


@pytest.mark.parametrize(
    "field,value",
    [("n_group", 8), ("topk_group", 4), ("kv_lora_rank", 512), ("q_lora_rank", 1536), ("scoring_func", "sigmoid"),
     ("routed_scaling_factor", 2.5), ("n_shared_experts", 2), ("first_k_dense_replace", 1),
     ("moe_shared_expert_count", 2), ("use_sliding_window", True)],
)  # fmt: skip
def test_unsupported_moe_variants_are_refused_naming_file_and_field(field, value):
    with pytest.raises(ValueError, match=rf"config\.json: {field} .*not supported"):
        ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], **BASE, field: value})


def test_the_grouped_top_k_fields_are_refused_on_any_architecture():
    with pytest.raises(ValueError, match="n_group"):
        _cfg("LlamaForCausalLM", n_group=8, topk_group=4)


@pytest.mark.parametrize(
    "arch,kw,match",
    [
        ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok 5 .* num_experts 4"),
        ("MixtralForCausalLM", dict(num_local_experts=2, num_experts_per_tok=3), "num_local_experts 2"),
        ("Qwen2MoeForCausalLM", dict(decoder_sparse_step=0), "decoder_sparse_step"),
        ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[9]), "mlp_only_layers"),
    ],
)
def test_bad_expert_counts_are_refused(arch, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(arch, **kw)


def test_a_missing_expert_tensor_is_named(tmp_path):
    d = write_random_model(tmp_path / "m", **MOE_SHAPES["MixtralForCausalLM"])
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        load_model(d)


# ------------------------------------------------------------------------------------------ forward
def _metadata(block_row, start, n, decode):
    """One sequence's tokens ``start .. start + n - 1`` as a decode row or a prefill chunk (blocks of 4)."""
    positions = np.arange(start, start + n)
    slots = np.array([block_row[p // 4] * 4 + p % 4 for p in positions], np.int64)
    table = np.array([block_row], np.int32)
    empty = np.zeros((0, table.shape[1]), np.int32)
    if decode:
        return positions, AttentionMetadata(slots, 1, table, np.array([start + 1], np.int32), empty,
                                            np.zeros(1, np.int32), np.zeros(0, np.int32), 0, start + 1)  # fmt: skip
    return positions, AttentionMetadata(slots, 0, empty, np.zeros(0, np.int32), table,
                                        np.array([0, n], np.int32), np.array([start + n], np.int32), n, 0)  # fmt: skip


def _teacher_forced(path, ids, chunks=((33, False), (1, True), (1, True), (5, False), (1, True))):
    config, _, _, weights = load_model(path)
    model = build_model(config, weights, CPUBackend(), "float32", 128)
    block_row = np.random.default_rng(1).permutation(40)[:14].astype(np.int32)
    shape = (40, 4, config.num_key_value_heads, config.head_dim)
    kc = [model.backend.allocate_kv_cache(shape, "float32") for _ in range(config.num_hidden_layers)]
    vc = [model.backend.allocate_kv_cache(shape, "float32") for _ in range(config.num_hidden_layers)]
    got, start = [], 0
    for n, decode in chunks:
        positions, attn = _metadata(block_row, start, n, decode)
        hidden = model.forward(np.array(ids[start : start + n], np.int64), positions, attn, kc, vc)
        got.append(model.compute_logits(hidden))
        start += n
    return np.concatenate(got)


@pytest.mark.parametrize("arch,num_shards", [(a, 1) for a in ARCHS] + [("Qwen2MoeForCausalLM", 3)])
def test_teacher_forced_logits_match_the_float64_reference(checkpoints, arch, num_shards):
    """A 33-token prefill chunk, single decode tokens and a 5-token chunk, blocks scattered: every
    position's logits equal the reference's within 2e-5 (float32 kernels against float64; logits of
    order 1)."""
    path, cfg, w = checkpoints(arch, num_shards)
    ids = PROMPTS[4] + PROMPTS[2][:4]  # 41 tokens
    got = _teacher_forced(path, ids)
    want = forward(cfg, w, ids)
    assert np.abs(want).max() > 0.3, "logits too flat to compare"
    delta = np.abs(got - want).max()
    print(f"{arch} ({num_shards} shards): max |delta| {delta:.2e}, max |logit| {np.abs(want).max():.2f}")
    assert delta < 2e-5, f"{arch}: max |delta| {delta:.2e}"


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _check_returned(llm):
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    assert kv.block_pool.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_identical_with_and_without_batching_prefix_hits_and_preemption(checkpoints, arch):
    """One prompt at a time; all at once with chunked prefill and prefix caching, twice (the second time
    the cached prefixes hit); all at once in a pool too small for them (preemption by recompute): the same
    tokens each time, and every block back at the end. The fused CPU decode steps aside (dense layers only)."""
    path, _, _ = checkpoints(arch)
    one = LLM(model=str(path), device="cpu", num_kv_blocks=64, block_size=4)
    assert not one.engine.runner.fused_decode.supported
    want = [_greedy(one, [p])[0] for p in PROMPTS]
    assert len({tuple(t) for t in want}) > 1
    batched = LLM(model=str(path), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                  enable_prefix_caching=True)  # fmt: skip
    assert _greedy(batched, PROMPTS) == want
    assert _greedy(batched, PROMPTS) == want
    assert batched.stats()["prefix_cache_hits"] > 0
    _check_returned(batched)
    small = LLM(model=str(path), device="cpu", num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    assert _greedy(small, PROMPTS) == want
    assert small.stats()["num_preemptions"] > 0
    _check_returned(small)


# ------------------------------------------------------------------------------------------ unread experts
def _poisoned_mixtral(tmp_path, poison: bool):
    """A Mixtral of 5 experts, top 2, whose layer-0 router can never pick expert 4: its rows are u, -u,
    v, -v, 0, so for every input two of the first four logits are >= 0 = expert 4's (which loses ties,
    being the last). Expert 4's weights are NaN (``poison``) or zero."""
    d = write_random_model(tmp_path / ("poisoned" if poison else "clean"), weight_std=STD,
                           **dict(MOE_SHAPES["MixtralForCausalLM"], num_experts=5))  # fmt: skip
    tensors = load_file(str(d / "model.safetensors"))
    p = "model.layers.0.block_sparse_moe."
    router = tensors[p + "gate.weight"]
    router[1], router[3], router[4] = -router[0], -router[2], 0.0
    for n in ("w1", "w2", "w3"):
        tensors[p + f"experts.4.{n}.weight"][...] = np.nan if poison else 0.0
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_an_expert_no_token_selects_is_never_read(tmp_path):
    """NaN weights in the unreachable expert change nothing: teacher-forced logits (prefill and decode)
    equal the zero-weight model's bit for bit, and batched greedy tokens are the same."""
    poisoned, clean = _poisoned_mixtral(tmp_path, True), _poisoned_mixtral(tmp_path, False)
    ids = PROMPTS[4]
    chunks = ((30, False), (1, True), (5, False), (1, True))
    got, want = _teacher_forced(poisoned, ids, chunks), _teacher_forced(clean, ids, chunks)
    assert np.isfinite(got).all() and np.array_equal(got, want)
    llms = [LLM(model=str(d), device="cpu", num_kv_blocks=64, block_size=4) for d in (poisoned, clean)]
    assert _greedy(llms[0], PROMPTS) == _greedy(llms[1], PROMPTS)
