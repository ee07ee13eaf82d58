"""Loading PEFT adapters: the scale (lora_alpha / r, rsLoRA's lora_alpha / sqrt(r)), the tensors kept as
saved, and every refusal a ValueError naming the adapter and the field, through ``LLM.generate`` too (the
engine keeps serving, and nothing stays queued)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rawpaged import LLM, LoRARequest, SamplingParams
from rawpaged.lora.lora_model import LoRAModel
from rawpaged.lora.models import LoRAModelManager
from rawpaged.lora.peft_helper import PEFTHelper
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.testing.random_lora import write_random_adapter
from rawpaged.testing.random_model import write_random_model


@pytest.fixture(scope="module")
def model_config(lora_base):
    return ModelConfig.from_dict(json.loads((lora_base / "config.json").read_text()))


def _load(path, model_config, max_lora_rank=16, name="ad"):
    return LoRAModel.from_local_checkpoint(LoRARequest(name, 1, str(path)), model_config, max_lora_rank)


@pytest.mark.parametrize(("rslora", "want"), [(False, 32.0 / 16), (True, 32.0 / math.sqrt(16))])
def test_scale_is_alpha_over_r_or_over_sqrt_r_with_rslora(lora_base, model_config, tmp_path, rslora, want):
    path = write_random_adapter(tmp_path, lora_base, rank=16, lora_alpha=32.0, use_rslora=rslora)
    model = _load(path, model_config)
    assert model.rank == 16 and model.scaling == pytest.approx(want)
    saved = load_file(str(path / "adapter_model.safetensors"))
    a = saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    assert np.array_equal(model.layers[(1, "down_proj")].lora_a, a)
    assert len(model.layers) == 2 * 7


def test_a_subset_of_modules_leaves_the_others_unadapted(lora_base, model_config, tmp_path):
    path = write_random_adapter(tmp_path, lora_base, rank=4, target_modules=("k_proj", "up_proj"))
    manager = LoRAModelManager(model_config, max_loras=2, max_lora_rank=8)
    manager.add_adapter(LoRARequest("sub", 7, str(path)))
    slot = manager.activate([7])[7]
    assert manager.ranks[(0, "k_proj")][slot] == 4 and manager.ranks[(0, "q_proj")][slot] == 0
    assert not manager.lora_a[(0, "q_proj")][slot].any()


def _rewrite(path, edit_config=None, edit_tensors=None):
    if edit_config:
        cfg = json.loads((path / "adapter_config.json").read_text())
        edit_config(cfg)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _other_base(tmp_path):
    return write_random_model(tmp_path / "other", num_layers=2, hidden_size=64, num_heads=8, head_dim=8, seed=2)


BAD = {
    "rank over max_lora_rank": (lambda p, t: write_random_adapter(p, t, rank=32), r"rank \(r\) 32 .*max_lora_rank 16"),
    "a module the model lacks": (
        lambda p, t: _rewrite(
            write_random_adapter(p, t),
            edit_tensors=lambda w: w.update(
                {
                    "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": np.zeros((8, 72), np.float32),
                    "base_model.model.model.layers.5.self_attn.q_proj.lora_B.weight": np.zeros((72, 8), np.float32),
                }
            ),
        ),
        "target module .*layers.5.self_attn.q_proj.*no such linear",
    ),
    "lm_head": (
        lambda p, t: _rewrite(
            write_random_adapter(p, t),
            edit_tensors=lambda w: w.update({"base_model.model.lm_head.lora_A.weight": np.zeros((8, 72), np.float32)}),
        ),
        "lm_head.*not a LoRA weight of a targetable linear",
    ),
    "another base's shapes": (
        lambda p, t: write_random_adapter(p, _other_base(p.parent)),
        "shape mismatch with the base model",
    ),
    "a missing lora_B": (
        lambda p, t: _rewrite(
            write_random_adapter(p, t),
            edit_tensors=lambda w: w.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"),
        ),
        "layer 0 up_proj has no lora_B",
    ),
    "no adapter_config.json": (
        lambda p, t: (write_random_adapter(p, t) / "adapter_config.json").unlink() or p,
        "adapter_config.json not found",
    ),
    "no weights file": (
        lambda p, t: (write_random_adapter(p, t) / "adapter_model.safetensors").unlink() or p,
        "adapter_model.safetensors not found",
    ),
    "a .bin checkpoint": (
        lambda p, t: (write_random_adapter(p, t) / "adapter_model.safetensors").rename(p / "adapter_model.bin") and p,
        r"adapter_model.bin .*not supported",
    ),
    "a missing directory": (lambda p, t: p / "nowhere", "is not a directory"),
    "DoRA": (
        lambda p, t: _rewrite(write_random_adapter(p, t), edit_config=lambda c: c.update(use_dora=True)),
        "use_dora",
    ),
    "a bias": (
        lambda p, t: _rewrite(write_random_adapter(p, t), edit_config=lambda c: c.update(bias="all")),
        "bias 'all'",
    ),
    "modules_to_save": (
        lambda p, t: _rewrite(write_random_adapter(p, t), edit_config=lambda c: c.update(modules_to_save=["lm_head"])),
        "modules_to_save",
    ),
    "no rank": (
        lambda p, t: _rewrite(write_random_adapter(p, t), edit_config=lambda c: c.pop("r")),
        "r must be a positive number",
    ),
    "a tensor outside target_modules": (
        lambda p, t: _rewrite(write_random_adapter(p, t), edit_config=lambda c: c.update(target_modules=["q_proj"])),
        "not in target_modules",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_refused_naming_the_adapter_and_the_field(lora_base, model_config, tmp_path, case):
    make, pattern = BAD[case]
    path = make(tmp_path / "ad", lora_base)
    with pytest.raises(ValueError, match=pattern) as e:
        _load(path, model_config, name="my-adapter")
    assert "LoRA adapter 'my-adapter'" in str(e.value)


def test_the_engine_refuses_a_bad_adapter_and_keeps_serving(lora_base, tmp_path):
    good = write_random_adapter(tmp_path / "good", lora_base, rank=8)
    bad = write_random_adapter(tmp_path / "bad", lora_base, rank=32)
    llm = LLM(model=str(lora_base), device="cpu", num_kv_blocks=32, max_model_len=128, enable_lora=True)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = ["one", "two"]
    with pytest.raises(ValueError, match="LoRA adapter 'big'.*max_lora_rank 16") as e:
        llm.generate(prompts, params, lora_request=[LoRARequest("ok", 1, str(good)), LoRARequest("big", 2, str(bad))])
    assert e.value.param == "lora_request"
    assert not llm.engine.has_unfinished_requests()  # the good one was taken back
    assert llm.stats()["num_used_blocks"] == 0
    out = llm.generate(prompts, params, lora_request=LoRARequest("ok", 1, str(good)))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    with pytest.raises(ValueError, match="lora_int_id 1 is already the id of adapter 'ok'"):
        llm.generate(prompts, params, lora_request=LoRARequest("other", 1, str(bad)))
    with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts"):
        llm.generate(prompts, params, lora_request=[None])


def test_lora_requests_need_enable_lora(lora_base, tmp_path):
    path = write_random_adapter(tmp_path / "a", lora_base)
    llm = LLM(model=str(lora_base), device="cpu", num_kv_blocks=16, max_model_len=128)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate("hi", SamplingParams(max_tokens=2), lora_request=LoRARequest("a", 1, str(path)))


def test_bad_requests_and_settings():
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="max_lora_rank must be an int >= 1"):
        LLM(model="unused", enable_lora=True, max_lora_rank=0)
    helper = PEFTHelper(r=4, lora_alpha=8, target_modules="all-linear")
    assert helper.targets("model.layers.3.mlp.down_proj") and not helper.targets("lm_head")
    regex = PEFTHelper(r=4, lora_alpha=8, target_modules=r".*\.(q|v)_proj")
    assert regex.targets("model.layers.0.self_attn.v_proj") and not regex.targets("model.layers.0.self_attn.k_proj")
