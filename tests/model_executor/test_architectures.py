"""Every architecture x RoPE variant against a float64 reference written from the published definitions
(``tests/model_reference.py``; its greedy ids and top-2 margins are recorded in
``fixtures/reference_architectures.json`` by ``python -m tests.model_reference``).

The engine runs on small random checkpoints written here, batched (a small pool, so sequences are
preempted and recomputed; chunked prefill; two prompts sharing a cached prefix) and one prompt at a time,
on the CPU and on the CUDA kernels through the CPU emulation (``CUDA_CASES``). Ids are compared up to the
first step where the reference's top-2 margin falls below 1e-3 (none does in the recorded cases).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from tests.conftest import FIXTURES
from tests.cuda_emu import Emulator, build, emulated_backend, missing_requirements
from tests.model_reference import (
    ARCHS,
    FIXTURE,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    ROPES,
    decisive_prefix,
    forward,
    write_checkpoint,
)

CASES = [(a, r) for a in ARCHS for r in ROPES]
#: On the emulated CUDA kernels (about 15 s a case on 2 cores): every architecture with default RoPE and
#: every variant on Mistral (window and variant together); all 20 with RAWPAGED_TEST_FULL_MATRIX=1.
CUDA_CASES = (
    CASES
    if os.environ.get("RAWPAGED_TEST_FULL_MATRIX") == "1"
    else [(a, "default") for a in ARCHS] + [("mistral", r) for r in ROPES if r != "default"]
)
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def recorded():
    data = json.loads((FIXTURES / FIXTURE).read_text())
    assert data["prompts"] == PROMPTS and data["max_tokens"] == MAX_TOKENS
    return data["cases"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, rope) -> (directory, config, float64 tensors), written once per module."""
    root = tmp_path_factory.mktemp("archs")
    cache = {}

    def get(arch, rope):
        if (arch, rope) not in cache:
            d = root / f"{arch}-{rope}"
            cache[(arch, rope)] = (d, *write_checkpoint(d, arch, ROPES[rope]))
        return cache[(arch, rope)]

    return get


def _greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _check(got: list, case: dict, label: str):
    k = decisive_prefix(case["ids"], case["margins"], MIN_MARGIN)
    assert got[:k] == case["ids"][:k], f"{label}: {got} != reference {case['ids']} (decisive steps: {k})"


ALL = tuple(range(len(PROMPTS)))


def _run_and_compare(llm, recorded_case, label, alone=ALL):
    """Batched (all prompts at once, a pool too small for all: preemption), then the prompts ``alone``
    one by one."""
    params = _greedy()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    stats = llm.engine.stats()
    for i, (out, case) in enumerate(zip(outs, recorded_case)):
        _check(list(out.outputs[0].token_ids), case, f"{label} batched prompt {i}")
    for i in alone:
        out = llm.generate({"prompt_token_ids": PROMPTS[i]}, params)[0]
        _check(list(out.outputs[0].token_ids), recorded_case[i], f"{label} alone prompt {i}")
    llm.engine.kv_cache_manager.check_invariants()
    return stats


def _num_kv_blocks(arch: str) -> int:
    """A pool the batched prompts overflow (preemption): a windowed model gives blocks back as it goes."""
    return 12 if arch == "mistral" else 48


def _engine(path, num_kv_blocks=48, **kw):
    return LLM(
        model=str(path),
        device="cpu",
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        **kw,
    )


@pytest.mark.parametrize("arch,rope", CASES, ids=[f"{a}-{r}" for a, r in CASES])
def test_recorded_reference_is_the_float64_forward(checkpoints, recorded, arch, rope):
    """The fixture is what the reference computes now: one forward over prompt + recorded ids gives the
    recorded ids as its argmax at every step, with the recorded margins."""
    _, cfg, w = checkpoints(arch, rope)
    for prompt, case in zip(PROMPTS, recorded[f"{arch}/{rope}"]):
        logits = forward(cfg, w, prompt + case["ids"][:-1], MAX_MODEL_LEN)[len(prompt) - 1 :]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        np.testing.assert_allclose(top2[:, 1] - top2[:, 0], case["margins"], atol=2e-6)
        assert list(np.argmax(logits, axis=-1)) == case["ids"]


@pytest.mark.parametrize("arch,rope", CASES, ids=[f"{a}-{r}" for a, r in CASES])
def test_cpu_engine_matches_reference(checkpoints, recorded, arch, rope):
    path, cfg, _ = checkpoints(arch, rope)
    llm = _engine(path, _num_kv_blocks(arch))
    assert llm.engine.max_model_len == MAX_MODEL_LEN
    stats = _run_and_compare(llm, recorded[f"{arch}/{rope}"], f"cpu {arch}/{rope}")
    assert stats["num_preemptions"] > 0, "the batched run should preempt"
    assert stats["prefix_cache_hits"] > 0, "the shared prefix should hit the cache"


_why = missing_requirements()


@pytest.fixture(scope="module")
def emu():
    if _why is not None:
        pytest.skip(f"CUDA emulation unavailable: {_why}")
    return Emulator(build())


@pytest.mark.parametrize("arch,rope", CUDA_CASES, ids=[f"{a}-{r}" for a, r in CUDA_CASES])
def test_emulated_cuda_engine_matches_reference(checkpoints, recorded, emu, monkeypatch, arch, rope):
    """The CUDA kernels (float32), run by the real CudaBackend through the CPU emulation. One by one
    only the longest prompt (beyond every original context and the window): the emulation is slow."""
    from rawpaged.engine import llm_engine as engine_mod

    monkeypatch.setattr(engine_mod, "get_backend", lambda device: emulated_backend(emu, num_sms=4))
    path, _, _ = checkpoints(arch, rope)
    llm = LLM(
        model=str(path),
        device="cuda",
        dtype="float32",
        num_kv_blocks=_num_kv_blocks(arch),
        block_size=4,
        max_num_batched_tokens=32,
    )
    assert llm.engine.backend.name == "cuda"
    stats = _run_and_compare(llm, recorded[f"{arch}/{rope}"], f"cuda-emulated {arch}/{rope}", alone=[3])
    assert stats["num_preemptions"] > 0


def test_a_windowed_model_gives_blocks_back_and_matches_the_reference(checkpoints):
    """Mistral's window W = 12, blocks of 4: decoding 8 W tokens, a sequence never holds more than
    ceil(W / 4) + 1 blocks (those wholly before its window go back to the pool as it goes), and the greedy
    ids equal the float64 reference's over its decisive steps."""
    from rawpaged.core.block_table import NULL_BLOCK
    from tests.model_reference import greedy_reference

    path, cfg, w = checkpoints("mistral", "default")
    window = cfg["sliding_window"]
    llm = _engine(path)
    kv = llm.engine.kv_cache_manager
    assert kv.sliding_window == window
    held = []
    allocate = kv.allocate_slots

    def recording(seq, n, *hits):
        ok = allocate(seq, n, *hits)
        held.append(sum(b != NULL_BLOCK for b in seq.block_table.block_ids))
        return ok

    kv.allocate_slots = recording
    prompt = PROMPTS[0][:8]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8 * window, ignore_eos=True)
    )
    ids = list(out[0].outputs[0].token_ids)
    assert len(ids) == 8 * window and max(held[1:]) <= -(-window // 4) + 1 and kv.num_window_frees > 0
    want, margins = greedy_reference(cfg, w, prompt, 8 * window, MAX_MODEL_LEN)
    k = decisive_prefix(want, margins, MIN_MARGIN)
    assert k > 4 * window and ids[:k] == want[:k]
    kv.check_invariants()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
