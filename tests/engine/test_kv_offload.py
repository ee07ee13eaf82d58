"""The second KV tier through the engine, on a small random model: preemption by swapping gives the
unpressured run's tokens; a conversation whose blocks were evicted from the pool comes back from the tier;
a persistent tier outlives the engine; and a tier file that is another model's, truncated, corrupted,
killed mid-store or cannot be made is never served, with a warning. After each run every block is free."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.core.kv_offload import KVTransfers
from rawpaged.kernels.kv_cache import QuantizedKVCache
from rawpaged.model_executor.kv_offload_store import HostKVStore, SlotLayout
from rawpaged.model_executor.model_runner import ModelRunner
from rawpaged.testing.random_model import write_random_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("tier") / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=3,
    )


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, 200, 30 + 12 * i)]} for i in range(n)]


def _ids(outs) -> list:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _all_free(llm):
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.kv_cache_manager.check_invariants()
    tier = llm.engine.scheduler.kv_tier
    if tier is not None:
        tier = tier.manager
        tier.check_invariants()
        assert tier.num_swap_blocks == 0
    return stats


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_swapping_gives_the_unpressured_tokens_and_copies_shared_blocks_once(model, kv_cache_dtype):
    """A pool a quarter of what the batch needs: with swapping, requests (n = 2 ones among them, whose
    samples share the prompt's blocks) are swapped out and back in, and every token equals the run with
    room; with recompute as well, and both count their preemptions."""
    prompts = _prompts()
    params = [
        SamplingParams(n=2 if i % 3 == 0 else 1, temperature=0.0, max_tokens=24, ignore_eos=True) for i in range(6)
    ]
    kw = dict(model=str(model), block_size=16, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    roomy = _ids(LLM(num_kv_blocks=256, **kw).generate(prompts, params))
    runs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(num_kv_blocks=12, kv_offloading_size=0.01, preemption_mode=mode, **kw)
        assert _ids(llm.generate(prompts, params)) == roomy
        runs[mode] = _all_free(llm)
        llm.close()
    swap, recompute = runs["swap"], runs["recompute"]
    assert swap["num_swapped_out"] > 0 and swap["num_swapped_in"] == swap["num_swapped_out"]
    assert swap["kv_offload"]["swap_in_blocks"] == swap["kv_offload"]["swap_out_blocks"] > 0
    assert recompute["num_preemptions"] > 0 and recompute["num_swapped_out"] == 0


def test_an_evicted_conversation_comes_back_from_the_tier(model):
    """A long prompt, then other requests that reuse every pool block, then the long prompt again: its
    blocks are loaded from the tier (cached tokens) and the output is the first answer."""
    llm = LLM(model=str(model), num_kv_blocks=24, block_size=16, kv_offloading_size=0.01)
    long = {"prompt_token_ids": [int(t) for t in np.random.default_rng(9).integers(3, 200, 300)]}
    first = llm.generate([long], GREEDY)[0]
    for p in _prompts(seed=1):
        llm.generate([p], GREEDY)
    hits = llm.stats()["kv_offload"]["prefix_hits"]
    again = llm.generate([long], GREEDY)[0]
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert again.num_cached_tokens >= 288 and llm.stats()["kv_offload"]["prefix_hits"] - hits >= 18
    _all_free(llm)
    llm.close()


def _persistent(model, tier_dir, **kw):
    return LLM(
        model=str(model), num_kv_blocks=40, block_size=16, kv_offloading_size=0.01, kv_offload_dir=str(tier_dir), **kw
    )


def _tier_file(tier_dir) -> Path:
    (path,) = Path(tier_dir).glob("kv-*.bin")
    return path


def test_a_persistent_tier_outlives_the_engine(model, tmp_path, caplog):
    long = {"prompt_token_ids": [int(t) for t in np.random.default_rng(5).integers(3, 200, 200)]}
    llm = _persistent(model, tmp_path)
    first = list(llm.generate([long], GREEDY)[0].outputs[0].token_ids)
    stored = llm.stats()["kv_offload"]["prefix_stores"]
    assert stored >= 12  # written through as its blocks filled
    llm.close()
    again = _persistent(model, tmp_path)
    assert again.stats()["kv_offload"]["restored"] == stored
    out = again.generate([long], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == first and out.num_cached_tokens >= 192
    _all_free(again)
    again.close()
    # another model's engine names another file, and finds nothing there
    other = write_random_model(
        tmp_path / "other",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seed=4,
    )
    llm = _persistent(other, tmp_path)
    assert llm.stats()["kv_offload"]["restored"] == 0
    llm.close()


def test_a_truncated_or_corrupted_tier_file_is_ignored_block_by_block(model, tmp_path, caplog):
    long = {"prompt_token_ids": [int(t) for t in np.random.default_rng(6).integers(3, 200, 200)]}
    llm = _persistent(model, tmp_path)
    first = list(llm.generate([long], GREEDY)[0].outputs[0].token_ids)
    stored = llm.stats()["kv_offload"]["prefix_stores"]
    llm.close()
    path = _tier_file(tmp_path)
    size = path.stat().st_size
    slot_bytes = 2 * 16 * 2 * 64 * 4 * 2  # 2 layers x K/V x 16 tokens x 2 heads x 64 x float32
    with open(path, "r+b") as f:  # one byte flipped in the first slot, the file cut inside the last
        data_start = size - 327 * slot_bytes
        f.seek(data_start + 100)
        b = f.read(1)
        f.seek(data_start + 100)
        f.write(bytes([b[0] ^ 0xFF]))
        f.truncate(data_start + (stored - 1) * slot_bytes + slot_bytes // 2)
    with caplog.at_level(logging.WARNING, logger="rawpaged.kv_offload"):
        again = _persistent(model, tmp_path)
    assert "truncated or corrupted" in caplog.text
    assert again.stats()["kv_offload"]["restored"] == stored - 2
    assert list(again.generate([long], GREEDY)[0].outputs[0].token_ids) == first
    _all_free(again)
    again.close()


def test_another_models_file_is_replaced_with_a_warning(model, tmp_path, caplog):
    llm = _persistent(model, tmp_path)
    llm.generate(_prompts(1), GREEDY)
    llm.close()
    path = _tier_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"head_dim": 64', b'"head_dim": 65', 1))  # a header of another geometry
    with caplog.at_level(logging.WARNING, logger="rawpaged.kv_offload"):
        again = _persistent(model, tmp_path)
    assert "ignored and replaced" in caplog.text and again.stats()["kv_offload"]["restored"] == 0
    assert _ids(again.generate(_prompts(1), GREEDY))
    again.close()


def test_a_tier_file_that_cannot_be_made_disables_the_tier(model, tmp_path, monkeypatch, caplog):
    """A full disk (the file's space cannot be allocated): the engine runs without the tier, correctly."""

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with caplog.at_level(logging.WARNING, logger="rawpaged.engine"):
        llm = _persistent(model, tmp_path)
    assert "second KV tier disabled" in caplog.text and llm.stats()["kv_offload"] is None
    want = _ids(LLM(model=str(model), num_kv_blocks=40, block_size=16).generate(_prompts(3), GREEDY))
    assert _ids(llm.generate(_prompts(3), GREEDY)) == want
    _all_free(llm)


def test_a_tier_too_small_for_anything_falls_back_to_recompute(model):
    """A size cap of a few blocks: swaps are refused (recompute), stores evict each other; tokens exact."""
    prompts, kw = _prompts(), dict(model=str(model), block_size=16)
    want = _ids(LLM(num_kv_blocks=256, **kw).generate(prompts, GREEDY))
    small = 3 * 2 * 2 * 16 * 2 * 64 * 4 / 2**30  # three blocks
    llm = LLM(num_kv_blocks=12, kv_offloading_size=small, **kw)
    assert llm.stats()["kv_offload"]["num_slots"] == 3
    assert _ids(llm.generate(prompts, GREEDY)) == want
    stats = _all_free(llm)
    assert stats["num_preemptions"] > stats["num_swapped_out"]  # some had to recompute
    llm.close()


def test_a_kill_during_stores_leaves_no_block_that_is_served_wrong(model, tmp_path):
    """A process writing through to the tier is killed (SIGKILL) while it generates; a new engine on the
    same directory gives the tokens of an engine without any tier."""
    script = textwrap.dedent(
        f"""
        import numpy as np
        from rawpaged import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, num_kv_blocks=40, block_size=16, kv_offloading_size=0.01,
                  kv_offload_dir={str(tmp_path)!r})
        rng = np.random.default_rng(11)
        print("ready", flush=True)
        while True:
            llm.generate([{{"prompt_token_ids": [int(t) for t in rng.integers(3, 200, 150)]}}],
                         SamplingParams(max_tokens=4, ignore_eos=True))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(4)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(11).integers(3, 200, 150)]}]
    want = _ids(LLM(model=str(model), num_kv_blocks=40, block_size=16).generate(prompts, GREEDY))
    llm = _persistent(model, tmp_path)
    assert _ids(llm.generate(prompts, GREEDY)) == want
    _all_free(llm)
    llm.close()


@pytest.mark.parametrize(
    "change", [{"quantization": "q8_0"}, {"kv_cache_dtype": "int8"}, {"block_size": 8}], ids=lambda c: next(iter(c))
)
def test_a_restart_with_one_kv_setting_changed_gets_no_hit(model, tmp_path, change):
    """The tier's file and the prefix hashes' root are keyed by everything that changes KV values: a
    restart that changes one such setting alone restores nothing and computes the whole prompt."""
    long = {"prompt_token_ids": [int(t) for t in np.random.default_rng(7).integers(3, 200, 103)]}
    kw = dict(model=str(model), num_kv_blocks=40, kv_offloading_size=0.01, kv_offload_dir=str(tmp_path))
    llm = LLM(**{**kw, "block_size": 16})
    llm.generate([long], GREEDY)
    assert llm.stats()["kv_offload"]["prefix_stores"] >= 6
    key, root = llm.engine.kv_cache_key, llm.engine.kv_cache_manager.root_hash
    llm.close()
    again = LLM(**{**kw, "block_size": 16, **change})
    assert again.engine.kv_cache_key != key and again.engine.kv_cache_manager.root_hash != root
    assert again.stats()["kv_offload"]["restored"] == 0
    first, second = (again.generate([long], GREEDY)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0  # its own blocks, once computed
    assert again.stats()["kv_offload"]["prefix_hits"] == 0
    _all_free(again)
    again.close()
    assert len(list(tmp_path.glob("kv-*.bin"))) == 2  # one file per key; the first one's is left as it was


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_a_runner_takes_its_store_in_its_constructor_and_a_block_comes_back_bit_for_bit(model, kv_cache_dtype):
    """The store is made before the runner, from the caches' geometry alone (``SlotLayout``): a block of every
    layer's K and V (values and scales) stored to a slot and loaded into another block is the same bytes."""
    llm = LLM(model=str(model), num_kv_blocks=4, block_size=16, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    mc = engine.model_config
    layout = SlotLayout.of(mc.num_hidden_layers, 16, mc.num_key_value_heads, mc.head_dim, kv_cache_dtype)
    store = HostKVStore(engine.backend, layout, 2)
    runner = ModelRunner(engine.model, 4, 16, kv_cache_dtype, kv_store=store)
    assert runner.kv_store is store
    rng = np.random.default_rng(0)
    arrays = [a for c in runner.key_caches + runner.value_caches for a in _arrays(c)]
    for a in arrays:
        a[1] = rng.integers(0, 256, a[1].nbytes, dtype=np.uint8).view(a.dtype).reshape(a[1].shape)
    runner.run_kv_transfers(KVTransfers([(1, 1)], [(1, 3)]))
    assert all(a[3].tobytes() == a[1].tobytes() != bytes(a[1].nbytes) for a in arrays)
    assert all(a[2].tobytes() == bytes(a[2].nbytes) for a in arrays)  # nothing else written


def _arrays(cache) -> list:
    return [cache.data, cache.scales] if isinstance(cache, QuantizedKVCache) else [cache]


def test_every_step_ends_its_transfers_once_even_one_that_runs_no_model(model):
    """Under swapping, a step that only swaps a request back in runs no model; its copies run and its slots'
    pins end in the same one place as any step's (the scheduler's ``update_from_output``)."""
    llm = LLM(model=str(model), num_kv_blocks=12, block_size=16, kv_offloading_size=0.01, enable_prefix_caching=False)
    engine, ended = llm.engine, []
    tier = engine.scheduler.kv_tier
    end = tier.end_transfers
    tier.end_transfers = lambda: (ended.append(1), end())
    for i, p in enumerate(_prompts()):
        engine.add_request(p, GREEDY, request_id=str(i))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert len(ended) == steps and tier.manager.check_invariants() is None
        assert all(s.pins == 0 for s in tier.manager._slots)
    assert engine.scheduler.stats.num_steps < steps, "no step without a model: the case is not covered"
    assert engine.stats()["num_swapped_in"] > 0
    _all_free(llm)
    llm.close()


def test_kv_offload_dir_without_a_tier_size_is_refused(model):
    with pytest.raises(ValueError, match="kv_offload_dir.*kv_offloading_size"):
        LLM(model=str(model), kv_offload_dir="/tmp/nowhere")
