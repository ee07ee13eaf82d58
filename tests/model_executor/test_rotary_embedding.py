"""RoPE variants: both config forms read alike, every type against the float64 reference of
``tests/model_reference.py`` at real models' settings, the properties that define each type, and a
clear ValueError for anything unsupported."""

import math

import numpy as np
import pytest

from rawpaged.model_executor.layers.rotary_embedding import RopeScaling, cos_sin_cache
from rawpaged.model_executor.model_config import ModelConfig
from tests.model_reference import rope_inv_freq

BASE = dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=8192)

#: Published configurations: Llama 3.1 8B, Qwen3 with YaRN as its card suggests, a DeepSeek-style YaRN
#: with mscale, CodeLlama-style linear, dynamic NTK.
REAL = {
    "llama3": dict(
        BASE,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "yarn": dict(
        BASE,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "yarn-mscale": dict(
        BASE,
        head_dim=64,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "linear": dict(BASE, rope_theta=1000000.0, rope_scaling={"type": "linear", "factor": 4.0}),
    "dynamic": dict(BASE, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}),
    "default": dict(BASE, rope_theta=10000.0),
}


def _v5(cfg):
    """The same config in transformers v5's form: ``rope_parameters`` holding type and theta."""
    cfg = dict(cfg)
    params = dict(cfg.pop("rope_scaling", None) or {"rope_type": "default"})
    params["rope_type"] = params.pop("type", None) or params.pop("rope_type")
    params["rope_theta"] = cfg.pop("rope_theta")
    return dict(cfg, rope_parameters=params)


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("max_model_len", [4096, 65536])
def test_inv_freq_matches_reference_in_both_config_forms(name, max_model_len):
    cfg = REAL[name]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    want, want_attn = rope_inv_freq(cfg, max_model_len)
    for form in (cfg, _v5(cfg)):
        rope = RopeScaling.from_hf_config(form)
        got, attn = rope.inv_freq(head_dim, form["max_position_embeddings"], max_model_len)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        assert attn == pytest.approx(want_attn, rel=1e-12)


def test_each_type_has_its_defining_properties():
    d = 128
    plain = 500000.0 ** (-np.arange(0, d, 2) / d)
    llama3, _ = RopeScaling.from_hf_config(REAL["llama3"]).inv_freq(d, 131072, 131072)
    wavelen = 2 * math.pi / plain
    assert np.array_equal(llama3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4]), "high frequencies kept"
    np.testing.assert_allclose(llama3[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-15)
    band = (wavelen >= 2048) & (wavelen <= 8192)
    assert band.any() and (llama3[band] < plain[band]).all() and (llama3[band] > plain[band] / 8).all()

    linear, _ = RopeScaling.from_hf_config(REAL["linear"]).inv_freq(d, 8192, 8192)
    np.testing.assert_allclose(linear, 1e6 ** (-np.arange(0, d, 2) / d) / 4, rtol=1e-15)

    dyn = RopeScaling.from_hf_config(REAL["dynamic"])
    short, _ = dyn.inv_freq(d, 8192, 8192)
    np.testing.assert_allclose(short, 1e4 ** (-np.arange(0, d, 2) / d), rtol=1e-15)  # within L0: plain
    long, _ = dyn.inv_freq(d, 8192, 16384)
    theta = 1e4 * (2 * 16384 / 8192 - 1) ** (d / (d - 2))
    np.testing.assert_allclose(long, theta ** (-np.arange(0, d, 2) / d), rtol=1e-12)
    assert dyn.context_len(8192) == 16384

    yarn = RopeScaling.from_hf_config(REAL["yarn"])
    inv, attn = yarn.inv_freq(128, 40960, 131072)
    plain = 1e6 ** (-np.arange(0, 128, 2) / 128)
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1] / 4), "fast dims kept, slow interpolated"
    assert attn == pytest.approx(0.1 * math.log(4) + 1)
    assert yarn.context_len(40960) == 131072  # 32768 x 4
    _, attn = RopeScaling.from_hf_config(REAL["yarn-mscale"]).inv_freq(64, 8192, 8192)
    assert attn == pytest.approx((0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1))


def test_cos_sin_cache_scales_by_the_attention_factor():
    inv = np.array([1.0, 0.25])
    table = cos_sin_cache(inv, 1.5, 3)
    assert table.dtype == np.float32 and table.shape == (3, 4)
    np.testing.assert_allclose(table[2], 1.5 * np.array([math.cos(2), math.cos(0.5), math.sin(2), math.sin(0.5)]))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type 'mrope' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor is required"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor is required"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "factor must be a positive number"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "factor is required"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {}}},
            "per-layer-type",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4, "layer_types": []},
            "layer_types must list",
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 2"),
        ({"head_dim": 7}, "head_dim 7 must be even"),
        ({"architectures": ["Phi3ForCausalLM"]}, "not supported"),
    ],
)
def test_unsupported_configs_raise_one_clear_error(extra, match):
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        **{k: v for k, v in extra.items() if k != "architectures"},
    )
    cfg["architectures"] = extra.get("architectures", cfg["architectures"])
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_dict(cfg, "x/config.json")
    assert "x/config.json" in str(e.value)


def test_family_features_from_config():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    qwen3 = ModelConfig.from_dict(dict(base, architectures=["Qwen3ForCausalLM"], head_dim=16, sliding_window=4))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias, qwen3.sliding_window) == (True, 16, False, None)
    qwen2 = ModelConfig.from_dict(dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=4096))
    assert (qwen2.qk_norm, qwen2.attention_bias, qwen2.sliding_window) == (False, True, None)
    mistral = ModelConfig.from_dict(dict(base, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert (mistral.sliding_window, mistral.head_dim, mistral.num_key_value_heads) == (4096, 4, 2)
    assert (
        ModelConfig.from_dict(dict(base, architectures=["MistralForCausalLM"], sliding_window=None)).sliding_window
        is None
    )
    assert mistral.layer_types == ("sliding_attention",) and qwen2.layer_types == ("full_attention",)
    hybrid = dict(base, architectures=["Qwen2ForCausalLM"], num_hidden_layers=3, use_sliding_window=True)
    qwen2_swa = ModelConfig.from_dict(dict(hybrid, sliding_window=8, max_window_layers=1))
    assert qwen2_swa.layer_types == ("full_attention",) + ("sliding_attention",) * 2
    assert qwen2_swa.layer_windows() == (None, 8, 8)
    explicit = ["sliding_attention", "full_attention", "sliding_attention"]
    assert ModelConfig.from_dict(dict(hybrid, sliding_window=8, layer_types=explicit)).layer_windows() == (8, None, 8)
    assert ModelConfig.from_dict(dict(hybrid, sliding_window=None)).layer_windows() == (None,) * 3
    llama = ModelConfig.from_dict(dict(base, architectures=["LlamaForCausalLM"], rope_scaling=None))
    assert llama.rope == RopeScaling() and llama.context_len == 2048
