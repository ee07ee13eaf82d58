"""Gemma 2 and Gemma 3: config parsing as HF's configs read them, and the engine's forward against the
float64 reference written from HF's modeling files (``tests/gemma_reference.py``).

The checkpoints have a window of 8 and blocks of 4, so prompts run past the window over several blocks;
teacher-forced logits are compared step by step (prefill chunks, one of them long enough for the CPU's
BLAS-tiled prefill, then decode steps), and greedy generation through ``LLM`` on the CPU and on the CUDA
kernels through the CPU emulation.
"""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.model_executor.model_loader import load_model
from rawpaged.model_executor.model_parts import build_model
from rawpaged.model_executor.models.gemma import GemmaModel
from rawpaged.model_executor.models.llama import AttentionMetadata
from tests.cuda_emu import Emulator, build, emulated_backend, missing_requirements
from tests.gemma_reference import CONFIGS, forward, greedy_reference, write_checkpoint
from tests.model_reference import decisive_prefix

MIN_MARGIN = 1e-3
_rng = np.random.default_rng(55)
PROMPTS = [[int(t) for t in _rng.integers(3, 259, n)] for n in (5, 19, 37)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = (root / name, *write_checkpoint(root / name, name))
        return cache[name]

    return get


# ------------------------------------------------------------------------------------------ config
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8)  # fmt: skip


def _cfg(arch, **kw):
    return ModelConfig.from_dict({"architectures": [arch], **BASE, "num_hidden_layers": 7, **kw})


F, S = "full_attention", "sliding_attention"


def test_gemma3_layer_types_from_sliding_window_pattern():
    """HF's Gemma3TextConfig: layer i attends in full when (i + 1) % pattern == 0 (default pattern 6)."""
    assert _cfg("Gemma3ForCausalLM").layer_types == (S, S, S, S, S, F, S)
    cfg = _cfg("Gemma3ForCausalLM", sliding_window_pattern=2, sliding_window=16)
    assert cfg.layer_types == (S, F, S, F, S, F, S)
    assert cfg.layer_windows() == (16, None, 16, None, 16, None, 16)
    assert _cfg("Gemma3ForCausalLM", sliding_window_pattern=1).layer_types == (F,) * 7


def test_gemma2_alternates_from_a_sliding_layer_0():
    cfg = _cfg("Gemma2ForCausalLM", sliding_window=4)
    assert cfg.layer_types == (S, F, S, F, S, F, S) and cfg.layer_windows()[:2] == (4, None)


def test_an_explicit_layer_types_list_wins():
    types = [F, S, S, F, F, S, F]
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert _cfg(arch, layer_types=types, sliding_window_pattern=2).layer_types == tuple(types)
    with pytest.raises(ValueError, match="layer_types"):
        _cfg("Gemma3ForCausalLM", layer_types=[F, S])


def test_gemma_defaults_are_hf_s():
    g2 = _cfg("Gemma2ForCausalLM")
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert g2.sliding_window == 4096 and g2.rope.theta == 10000.0 and g2.local_rope is None and not g2.qk_norm
    assert g2.attention_scale == 256**-0.5 and g2.tie_word_embeddings and g2.gemma
    g3 = _cfg("Gemma3ForCausalLM")
    assert (g3.attn_logit_softcapping, g3.final_logit_softcapping) == (None, None) and g3.qk_norm
    assert g3.rope.theta == 1e6 and g3.local_rope.theta == 10000.0 and g3.hidden_activation == "gelu_pytorch_tanh"
    # HF's Gemma 3 attention ignores attn_logit_softcapping; Gemma 2's applies it
    assert _cfg("Gemma3ForCausalLM", attn_logit_softcapping=20.0).attn_logit_softcapping is None
    assert _cfg("Gemma2ForCausalLM", attn_logit_softcapping=None).attn_logit_softcapping is None


def test_gemma3_ropes_local_unscaled_global_scaled():
    cfg = _cfg(
        "Gemma3ForCausalLM",
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=1024,
    )
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 8.0)
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 2e4)
    ropes = cfg.layer_ropes()
    assert ropes[5] == cfg.rope and ropes[0] == ropes[6] == cfg.local_rope
    assert cfg.context_len == 1024  # Gemma 3's max_position_embeddings is the scaled context already
    v5 = _cfg(
        "Gemma3ForCausalLM",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
        },
        max_position_embeddings=1024,
    )
    assert (v5.rope, v5.local_rope) == (cfg.rope, cfg.local_rope)


def test_gemma_expected_shapes_name_the_four_norms_and_gemma3_s_qk_norms():
    g3 = _cfg("Gemma3ForCausalLM").expected_shapes()
    for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        assert g3[f"model.layers.6.{n}_layernorm.weight"] == (16,)
    assert g3["model.layers.0.self_attn.q_norm.weight"] == (8,) and "lm_head.weight" not in g3
    g2 = _cfg("Gemma2ForCausalLM").expected_shapes()
    assert "model.layers.0.pre_feedforward_layernorm.weight" in g2
    assert not any("q_norm" in n for n in g2)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("hidden_activation", "gelu", "hidden_activation"),
        ("attention_bias", True, "attention_bias"),
        ("sliding_window", None, "sliding_window"),
        ("sliding_window_pattern", 0, "sliding_window_pattern"),
        ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
        ("query_pre_attn_scalar", "x", "query_pre_attn_scalar"),
        ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_type"),
        ("rope_parameters", {"chunked_attention": {"rope_theta": 1.0}}, "rope_parameters"),
    ],
)
def test_what_cannot_be_computed_exactly_is_refused(field, value, match):
    with pytest.raises(ValueError, match=rf"config\.json.*{match}"):
        _cfg("Gemma3ForCausalLM", **{field: value})


def test_gemma2_reads_hidden_activation_not_hidden_act():
    cfg = _cfg("Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    assert cfg.hidden_activation == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_activation"):
        _cfg("Gemma2ForCausalLM", hidden_activation="relu")


# ------------------------------------------------------------------------------------------ forward
def _metadata(block_row, start, n, decode):
    """The attention metadata of one sequence's tokens ``start .. start + n - 1``, as a decode row or a
    prefill chunk."""
    bs = 4
    positions = np.arange(start, start + n)
    slots = np.array([block_row[p // bs] * bs + p % bs for p in positions], np.int64)
    table = np.array([block_row], np.int32)
    empty = np.zeros((0, table.shape[1]), np.int32)
    if decode:
        return positions, AttentionMetadata(slots, 1, table, np.array([start + 1], np.int32), empty,
                                            np.zeros(1, np.int32), np.zeros(0, np.int32), 0, start + 1)  # fmt: skip
    return positions, AttentionMetadata(slots, 0, empty, np.zeros(0, np.int32), table,
                                        np.array([0, n], np.int32), np.array([start + n], np.int32), n, 0)  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_teacher_forced_logits_match_the_float64_reference(checkpoints, name):
    """Chunks of 33 (the CPU's BLAS-tiled prefill), 5 and 13 tokens and single decode tokens, blocks in a
    scattered order: every position's logits equal the reference's over the whole sequence."""
    path, cfg, w = checkpoints(name)
    ids = PROMPTS[2] + PROMPTS[1][:18]  # 55 tokens, 7 windows of 8
    config, _, _, weights = load_model(path)
    model = build_model(config, weights, CPUBackend(), "float32", 128)
    assert isinstance(model, GemmaModel)
    block_row = np.random.default_rng(1).permutation(40)[:14].astype(np.int32)
    be = model.backend
    shape = (40, 4, config.num_key_value_heads, config.head_dim)
    kc = [be.allocate_kv_cache(shape, "float32") for _ in range(config.num_hidden_layers)]
    vc = [be.allocate_kv_cache(shape, "float32") for _ in range(config.num_hidden_layers)]
    got, start = [], 0
    for n, decode in ((33, False), (1, True), (1, True), (5, False), (1, True), (13, False), (1, True)):
        positions, attn = _metadata(block_row, start, n, decode)
        hidden = model.forward(np.array(ids[start : start + n], np.int64), positions, attn, kc, vc)
        got.append(model.compute_logits(hidden))
        start += n
    want = forward(cfg, w, ids)
    np.testing.assert_allclose(np.concatenate(got), want, rtol=2e-3, atol=2e-3)
    cap = cfg.get("final_logit_softcapping", 30.0 if name == "gemma2" else None)
    if cap:
        assert np.abs(want).max() > 0.5 * cap, "the soft-cap should bend the largest logits"


def _greedy_llm(llm, cfg, w, label):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        want, margins = greedy_reference(cfg, w, prompt, MAX_TOKENS)
        k = decisive_prefix(want, margins, MIN_MARGIN)
        assert k >= MAX_TOKENS // 2, f"{label}: too few decisive steps ({k}) to compare"
        assert list(out.outputs[0].token_ids)[:k] == want[:k], f"{label}: prompt of {len(prompt)}"
    llm.engine.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_cpu_engine_greedy_matches_the_reference(checkpoints, name):
    """Batched prompts of 5, 19 and 37 tokens (chunked prefill, prefix caching on), the decode steps in the
    CPU's fused decode."""
    path, cfg, w = checkpoints(name)
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True)  # fmt: skip
    assert llm.engine.max_model_len == 128
    assert llm.engine.runner.fused_decode.supported
    _greedy_llm(llm, cfg, w, f"cpu {name}")


_why = missing_requirements()


@pytest.fixture(scope="module")
def emu():
    if _why is not None:
        pytest.skip(f"CUDA emulation unavailable: {_why}")
    return Emulator(build())


@pytest.mark.parametrize("name,eager", [("gemma2", True), ("gemma3", True), ("gemma3", False)])
def test_emulated_cuda_engine_greedy_matches_the_reference(checkpoints, emu, monkeypatch, name, eager):
    """The CUDA kernels (float32: GeGLU, soft-capped decode and prefill attention, scaled embedding,
    float32 (1 + w) norm weights) run by the real CudaBackend through the CPU emulation; ``eager=False``:
    decode steps on the static buffers of the CUDA graph path, through a stand-in capture (a replay reruns
    the captured forward into the captured output)."""
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.kernels.cuda.backend import CudaBackend

    monkeypatch.setattr(engine_mod, "get_backend", lambda device: emulated_backend(emu, num_sms=4))

    def capture_graph(self, fn):
        output = fn()

        def replay():
            output[...] = fn()

        return replay, output

    monkeypatch.setattr(CudaBackend, "supports_cuda_graphs", True)
    monkeypatch.setattr(CudaBackend, "capture_graph", capture_graph)
    path, cfg, w = checkpoints(name)
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, enforce_eager=eager, max_num_seqs=4)  # fmt: skip
    assert llm.engine.backend.name == "cuda"
    _greedy_llm(llm, cfg, w, f"cuda-emulated {name} eager={eager}")
    if not eager:
        assert sum(llm.engine.runner.cuda_graph.num_steps.values()) > 0, "no decode step ran on the graph path"
