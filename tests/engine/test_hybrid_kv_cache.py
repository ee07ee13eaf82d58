"""The hybrid KV cache manager on a model with full and sliding layers (the random Qwen2 of
``tests/model_reference.py``: 2 full layers, then 2 with a window of 8; blocks of 4): with the groups on
and off (``disable_hybrid_kv_cache_manager``) the engine gives the float64 reference's greedy tokens through
preemption, chunked prefill and prefix hits, the same sampled tokens for ``n > 1`` and beam search, never
reads a freed block (poisoned with NaN before every step), and returns every block."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from tests.conftest import FIXTURES
from tests.model_reference import FIXTURE, MAX_TOKENS, PROMPTS, decisive_prefix, write_checkpoint

ARCH = "qwen2_hybrid"
MODES = {"hybrid": False, "hybrid-off": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid") / ARCH
    write_checkpoint(d, ARCH)
    return d


@pytest.fixture(scope="module")
def reference():
    return json.loads((FIXTURES / FIXTURE).read_text())["cases"][f"{ARCH}/default"]


def _engine(path, disable: bool, num_kv_blocks=48, **kw) -> LLM:
    return LLM(
        model=str(path),
        device="cpu",
        num_kv_blocks=num_kv_blocks,
        block_size=4,
        max_num_batched_tokens=32,
        disable_hybrid_kv_cache_manager=disable,
        **kw,
    )


def _poison_freed_blocks(llm: LLM, cached_too: bool) -> None:
    """Before every step, fill each free block of every pool tensor with NaN (with ``cached_too`` also the
    free blocks the prefix cache still names): a kernel that read one would turn its logits to NaN."""
    runner, pool = llm.engine.runner, llm.engine.kv_cache_manager.block_pool
    execute = runner.execute_model

    def poisoned(sched_out):
        free = [b for b in pool._free if cached_too or pool.blocks[b].block_hash is None]
        for t in runner.key_tensors + runner.value_tensors:
            t[free] = np.nan
        return execute(sched_out)

    runner.execute_model = poisoned


def _check_returned(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 and not b.owners for b in kv.block_pool.blocks)


def _greedy_batched(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_match_the_reference_with_groups_on_and_off(checkpoint, reference, mode):
    """All prompts at once (a pool they overflow: preemption by recompute), twice (the second time the
    cached prefixes hit), with free uncached blocks poisoned; then every block is back."""
    llm = _engine(checkpoint, MODES[mode])
    kv = llm.engine.kv_cache_manager
    assert kv.num_groups == (1 if MODES[mode] else 2)
    _poison_freed_blocks(llm, cached_too=False)
    for _ in range(2):
        got = _greedy_batched(llm)
        for i, (ids, case) in enumerate(zip(got, reference)):
            k = decisive_prefix(case["ids"], case["margins"], 1e-3)
            assert ids[:k] == case["ids"][:k], f"{mode} prompt {i}"
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert (stats["num_window_frees"] > 0) == (not MODES[mode])
    _check_returned(llm)


def test_without_prefix_caching_no_free_block_is_ever_read(checkpoint, reference):
    """Every free block poisoned before every step (no cache: none is meant to be read again)."""
    llm = _engine(checkpoint, False, enable_prefix_caching=False)
    _poison_freed_blocks(llm, cached_too=True)
    for i, (ids, case) in enumerate(zip(_greedy_batched(llm), reference)):
        k = decisive_prefix(case["ids"], case["margins"], 1e-3)
        assert ids[:k] == case["ids"][:k], f"prompt {i}"
    _check_returned(llm)


def test_a_sliding_group_holds_its_window_and_the_hybrid_pool_fits_more(checkpoint):
    """Decoding 60 tokens: the sliding group holds at most ceil(8 / 4) + 1 blocks; the peak pool use with
    groups, in bytes, is under 0.6 times what every layer's blocks take with the hybrid manager off."""
    peaks = {}
    for mode, disable in MODES.items():
        llm = _engine(checkpoint, disable)
        kv = llm.engine.kv_cache_manager
        held = []
        allocate = kv.allocate_slots

        def recording(seq, n, *hits, allocate=allocate, kv=kv, held=held):
            ok = allocate(seq, n, *hits)
            held.append([len(b) for b in kv.group_blocks(seq)])
            return ok

        kv.allocate_slots = recording
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        llm.generate({"prompt_token_ids": PROMPTS[1]}, params)
        if not disable:
            assert max(h[1] for h in held[1:]) <= 3 and max(h[0] for h in held) == -(-(23 + 60) // 4)
        tensors = llm.engine.runner.key_tensors + llm.engine.runner.value_tensors
        peaks[mode] = kv.block_pool.peak_used_blocks * sum(t[0].nbytes for t in tensors)  # bytes
        _check_returned(llm)
    # (21 full + 3 sliding blocks) x 2 layers against 21 blocks x 4 layers: 0.57
    assert peaks["hybrid"] < 0.6 * peaks["hybrid-off"]


def _sampled(llm: LLM, params: SamplingParams) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params)
    return [sorted(tuple(c.token_ids) for c in o.outputs) for o in outs]


@pytest.mark.parametrize(
    "params,num_kv_blocks",
    [
        (SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True), 40),
        (SamplingParams(n=2, beam_width=3, temperature=0.0, max_tokens=8, ignore_eos=True), 72),
    ],
    ids=["n3", "beam3"],
)
def test_forks_and_beams_give_the_same_tokens_with_groups_on_and_off(checkpoint, params, num_kv_blocks):
    """Forked sequences share every group's blocks and copy a partly filled one on write. The tokens equal
    the hybrid-off engine's (every layer's blocks kept)."""
    runs = {}
    for mode, disable in MODES.items():
        llm = _engine(checkpoint, disable, num_kv_blocks=num_kv_blocks)
        _poison_freed_blocks(llm, cached_too=False)
        runs[mode] = _sampled(llm, params)
        assert llm.stats()["num_cow_copies"] > 0
        _check_returned(llm)
    assert runs["hybrid"] == runs["hybrid-off"]


def test_abort_returns_every_groups_blocks(checkpoint):
    llm = _engine(checkpoint, False)
    engine = llm.engine
    ids = [
        engine.add_request({"prompt_token_ids": p}, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=30))
        for p in PROMPTS[2:]
    ]
    for _ in range(6):
        engine.step()
    kv = engine.kv_cache_manager
    kv.check_invariants(engine.scheduler.running)
    assert kv.block_pool.num_used_blocks > 0
    for request_id in ids:
        engine.abort_request(request_id)
    _check_returned(llm)


def _static_path_matches(llm: LLM, reference) -> None:
    graphs = llm.engine.runner.cuda_graph
    assert len(graphs.group_buffers) == 2
    for i, (ids, case) in enumerate(zip(_greedy_batched(llm), reference)):
        k = decisive_prefix(case["ids"], case["margins"], 1e-3)
        assert ids[:k] == case["ids"][:k], f"prompt {i}"
    assert sum(graphs.num_steps.values()) > 0  # decode steps ran on the per-group static buffers
    _check_returned(llm)


def test_the_static_decode_path_reads_each_groups_buffers(checkpoint, reference):
    """``--no-enforce-eager`` (the buffers a CUDA graph replays; kernel by kernel on the CPU): a block table
    and slot mapping per group, the reference's tokens."""
    _static_path_matches(_engine(checkpoint, False, enforce_eager=False, max_num_seqs=8), reference)


def test_the_cuda_kernels_with_groups_in_the_emulator(checkpoint, reference, monkeypatch):
    """The CUDA backend (float32, through the CPU emulation of its kernels) on the static decode path with
    two groups."""
    from rawpaged.engine import llm_engine as engine_mod
    from tests.cuda_emu import Emulator, build, emulated_backend, missing_requirements

    why = missing_requirements()
    if why is not None:
        pytest.skip(f"CUDA emulation unavailable: {why}")
    emu = Emulator(build())
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: emulated_backend(emu, num_sms=4))
    llm = LLM(
        model=str(checkpoint),
        device="cuda",
        dtype="float32",
        num_kv_blocks=48,
        block_size=4,
        max_num_batched_tokens=32,
        enforce_eager=False,
        max_num_seqs=8,
    )
    assert llm.engine.backend.name == "cuda"
    _static_path_matches(llm, reference)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_gives_the_same_tokens_with_groups_on_and_off(checkpoint, kv_cache_dtype):
    """int8 / fp8 blocks (values and scales) per group: the same greedy tokens as every layer's blocks."""
    runs = {}
    for mode, disable in MODES.items():
        llm = _engine(checkpoint, disable, kv_cache_dtype=kv_cache_dtype)
        runs[mode] = _greedy_batched(llm)
        _check_returned(llm)
    assert runs["hybrid"] == runs["hybrid-off"]


def test_swap_preemption_and_the_tier_give_the_reference_tokens(checkpoint, reference):
    """A pool the batch overflows, preemption by swapping every group's blocks to the second tier and back;
    then the prompts again, their prefixes evicted from the small pool and loaded from the tier."""
    llm = _engine(checkpoint, False, num_kv_blocks=40, kv_offloading_size=0.01, preemption_mode="swap")
    for _ in range(2):
        for i, (ids, case) in enumerate(zip(_greedy_batched(llm), reference)):
            k = decisive_prefix(case["ids"], case["margins"], 1e-3)
            assert ids[:k] == case["ids"][:k], f"prompt {i}"
    stats = llm.stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    assert stats["offload_prefix_hits"] > 0
    _check_returned(llm)
    llm.close()


def test_a_persistent_tier_serves_every_group_after_a_restart(checkpoint, reference, tmp_path):
    kw = dict(num_kv_blocks=48, kv_offloading_size=0.01, kv_offload_dir=str(tmp_path))
    llm = _engine(checkpoint, False, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[3]}
    first = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
    stored = llm.stats()["kv_offload"]["prefix_stores"]
    llm.close()
    again = _engine(checkpoint, False, **kw)
    assert again.stats()["kv_offload"]["restored"] == stored > 0
    out = again.generate(prompt, params)[0]
    assert list(out.outputs[0].token_ids) == first and out.num_cached_tokens >= 64
    k = decisive_prefix(reference[3]["ids"], reference[3]["margins"], 1e-3)
    assert first[:k] == reference[3]["ids"][:k]
    _check_returned(again)
    again.close()
    # the hybrid manager off: blocks of another layout, nothing found
    off = _engine(checkpoint, True, **kw)
    assert off.generate(prompt, params)[0].num_cached_tokens == 0
    off.close()


def test_speculative_drafts_verify_over_every_group(checkpoint, reference):
    """n-gram drafts verified as several decode rows per sequence, the rejected drafts' slots given back
    in each group: still the reference's greedy tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _engine(checkpoint, False, speculative_config=spec)
    for i, (ids, case) in enumerate(zip(_greedy_batched(llm), reference)):
        k = decisive_prefix(case["ids"], case["margins"], 1e-3)
        assert ids[:k] == case["ids"][:k], f"prompt {i}"
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    _check_returned(llm)
