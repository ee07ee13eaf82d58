"""No kernel compiles after the warm-up: in a fresh interpreter per configuration (``warmup_check``), an
engine warms up, then a request of each kind (sampling edits, logprobs, n>1 and its copy-on-write, beam
search, token bitmasks and grammars, long prompts, prefix hits, drafts, eight sequences at once) adds no
compiled signature to any kernel, neither a compile nor a load from Numba's cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rawpaged.engine.warmup import LONG_PROMPT, warmup_rounds
from rawpaged.kernels.cpu.quant import ROWS_MAX_BATCH

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = {
    "float32": {},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "fp8 KV": {"kv_cache_dtype": "fp8"},
    "q8_0": {"quantization": "q8_0"},
    "ngram drafts": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "op by op decode": {"fused_decode": False},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    """2 random layers with the default model's tokenizer (grammars compile on it), widths that q8_0
    quantizes (multiples of 32)."""
    from rawpaged.testing.random_model import write_random_model

    return write_random_model(
        tmp_path_factory.mktemp("warm"),
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tokenizer_from=model_dir,
        seed=1,
    )


def _check(config: dict) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "tests.engine.warmup_check", json.dumps(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _compiled_after_warmup(out: dict) -> dict:
    return {kind: k for kind, k in out.items() if kind != "(grammar)" and isinstance(k, list) and k}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_request_compiles_a_kernel_after_the_warmup(tiny_model, name):
    out = _check({"model": str(tiny_model), "max_model_len": 512, "num_kv_blocks": 256, **CONFIGS[name]})
    assert _compiled_after_warmup(out) == {}
    assert [k for k, v in out.items() if isinstance(v, str)] == []
    assert out["(grammar)"] is True  # the grammar requests ran (llguidance is a test dependency)


def test_no_request_compiles_a_kernel_after_the_warmup_of_a_k_quant_gguf(tmp_path):
    from tests.model_executor.test_gguf import _write_kquant_gguf

    path = tmp_path / "kmix.gguf"
    _write_kquant_gguf(path)
    out = _check({"model": str(path), "num_kv_blocks": 128})
    assert _compiled_after_warmup(out) == {}
    assert len([k for k, v in out.items() if isinstance(v, list)]) >= 20


@pytest.mark.parametrize("max_model_len", [16, 32, 100, 4096])
@pytest.mark.parametrize("num_blocks", [4, 64, 4096])
def test_the_warmup_requests_fit_the_context_the_batch_and_the_pool(max_model_len, num_blocks):
    rounds = warmup_rounds(max_model_len, 2048, num_blocks, 16, vocab_size=1000, grammar=True)
    for requests in rounds:
        for prompt, params in requests:
            assert 1 <= len(prompt) and len(prompt) + params.max_tokens <= max_model_len
            assert all(0 <= t < 1000 for t in prompt)
    long_prompt = rounds[0][0][0]
    if max_model_len >= 4096 and num_blocks >= 4096:
        assert len(long_prompt) == LONG_PROMPT > ROWS_MAX_BATCH  # the quantized SGEMM path is reached
    assert len(long_prompt) <= num_blocks * 16 // 4
