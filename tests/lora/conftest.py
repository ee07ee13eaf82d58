"""A tiny random Llama (weights N(0, 0.08), so greedy steps are decisive) and random PEFT adapters on it."""

import pytest

from rawpaged.testing.random_lora import write_random_adapter
from rawpaged.testing.random_model import write_random_model


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("lora-base"), num_layers=2, seed=1, weight_std=0.08)


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory):
    """Four adapters of every target module: ranks 8, 8 (rsLoRA), 16 and 4 (over q/v and down only)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = [
        dict(rank=8, seed=11),
        dict(rank=8, seed=12, use_rslora=True, lora_alpha=8.0),
        dict(rank=16, seed=13, lora_alpha=32.0),
        dict(rank=4, seed=14, target_modules=("q_proj", "v_proj", "down_proj")),
    ]
    return [write_random_adapter(root / f"a{i}", lora_base, std=0.1, **s) for i, s in enumerate(specs)]
