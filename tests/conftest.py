"""Shared fixtures. The default model is prepared once (downloaded and converted into weights/) and
reused by every test that needs it."""

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def model_dir():
    from rawpaged import weights

    return weights.prepare(progress=False)


@pytest.fixture(scope="session")
def llm(model_dir):
    """One CPU engine with a large pool, shared by tests that only read outputs and stats."""
    from rawpaged import LLM

    return LLM(model=str(model_dir), device="cpu", num_kv_blocks=512, max_model_len=1024)


@pytest.fixture(scope="session")
def reference_greedy():
    return json.loads((FIXTURES / "reference_greedy.json").read_text())
