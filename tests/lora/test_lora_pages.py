"""Adapters in pages of the KV block pool (S-LoRA's unified pool), through ``LLM.stats()``: an adapter's
pages come out of the free blocks, KV pressure evicts idle adapters before anyone is preempted, eviction
and reload (from the pool and from disk, ``max_cpu_loras``) change no output and leak no page, and a request
whose adapter is loading in the background waits without stalling the others."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

from rawpaged import LLM, LoRARequest, SamplingParams
from rawpaged.core.sequence import SequenceStatus
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.lora import page_store
from rawpaged.lora.lora_model import LoRAAdapterSpec, LoRAModel
from rawpaged.model_executor.model_config import ModelConfig
from rawpaged.model_executor.model_runner import kv_block_bytes
from rawpaged.testing.random_lora import write_random_adapter

MAX_LEN = 256
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw):
    return LLM(model=str(model_dir), device="cpu", max_model_len=MAX_LEN, enable_lora=True, **kw)


def _prompt(j: int, n: int = 12) -> dict:
    return {"prompt_token_ids": [(7 * i + 11 * j + 5) % 250 + 3 for i in range(n)]}


def _tokens(llm, prompts, loras, params=PARAMS) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]


def _pages(adapter_dir, block_bytes: int) -> int:
    """The adapter's pages, from its file: every tensor's float32 bytes over one block's bytes."""
    floats = sum(int(np.prod(t.shape)) for t in load_file(str(adapter_dir / "adapter_model.safetensors")).values())
    return math.ceil(4 * floats / block_bytes)


def _no_leak(llm) -> None:
    """free + used == total; used blocks are the idle adapters' pages alone, each held by its adapter only,
    no adapter has a running user and no KV block is referenced."""
    s = llm.stats()
    kv = llm.engine.kv_cache_manager
    pages = kv.adapter_pages
    assert s["num_free_blocks"] + s["num_used_blocks"] == s["num_total_blocks"]
    assert s["num_used_blocks"] == s["lora_adapter_pages"] == pages.num_idle_pages
    held = {b for blocks in pages.owner_blocks().values() for b in blocks}
    for b in kv.block_pool.blocks:
        assert b.ref_count == (1 if b.block_id in held else 0), b.block_id
    kv.check_invariants()
    assert not llm.engine.scheduler._lora_holders


@pytest.fixture(scope="module")
def many_adapters(lora_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    return [write_random_adapter(root / f"m{i}", lora_base, rank=4, std=0.15, seed=100 + i) for i in range(8)]


def test_an_adapter_in_use_lowers_the_free_blocks_by_its_pages(lora_base, adapters):
    llm = _engine(lora_base, num_kv_blocks=64)
    s0 = llm.stats()
    assert s0["num_free_blocks"] == 64 and s0["lora_adapters_resident"] == 0
    want = _pages(adapters[0], s0["kv_block_bytes"])
    assert llm.engine.runner.lora_manager.pages.page_bytes == s0["kv_block_bytes"]  # the pool's own block
    _tokens(llm, [_prompt(0)], LoRARequest("a", 1, str(adapters[0])))
    s = llm.stats()
    assert s["lora_adapters_resident"] == 1 and s["lora_adapter_pages"] == want > 1
    assert s["num_free_blocks"] == 64 - want  # the request's KV is back; the idle adapter stays resident
    assert s["lora_pool_loads"] == 1 and s["lora_loads"] == 1 and s["lora_evictions"] == 0
    _tokens(llm, [_prompt(1)], LoRARequest("b", 2, str(adapters[2])))  # a second adapter adds its pages
    s2 = llm.stats()
    assert s2["num_free_blocks"] == 64 - want - _pages(adapters[2], s0["kv_block_bytes"])
    assert s2["lora_adapters_resident"] == 2
    _no_leak(llm)


def test_kv_pressure_evicts_an_idle_adapter_before_preempting_and_the_reload_gives_the_same_tokens(lora_base, adapters):
    a = LoRARequest("a", 1, str(adapters[0]))
    llm = _engine(lora_base, num_kv_blocks=24, enable_prefix_caching=False)
    pages = _pages(adapters[0], llm.stats()["kv_block_bytes"])
    first = _tokens(llm, [_prompt(0)], a)
    assert llm.stats()["num_free_blocks"] == 24 - pages
    long = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _tokens(llm, [_prompt(3, n=16 * (24 - pages) + 8)], None, long)  # more KV than the adapter left free
    s = llm.stats()
    assert s["lora_evictions"] == 1 and s["lora_adapters_resident"] == 0 and s["num_preemptions"] == 0
    assert s["num_free_blocks"] == 24
    assert _tokens(llm, [_prompt(0)], a) == first  # paged in again
    assert llm.stats()["lora_pool_loads"] == 2
    _no_leak(llm)


def test_many_adapters_in_a_small_pool_change_no_output_and_leak_no_page(lora_base, many_adapters):
    loras = [LoRARequest(f"m{i}", i + 1, str(p)) for i, p in enumerate(many_adapters)]
    prompts = [_prompt(j) for j in range(16)]
    per_prompt = [loras[j % len(loras)] if j % 5 else None for j in range(16)]
    big = _engine(lora_base, num_kv_blocks=512, max_loras=8)
    alone = [_tokens(big, [p], lora)[0] for p, lora in zip(prompts, per_prompt)]
    pages = _pages(many_adapters[0], big.stats()["kv_block_bytes"])
    small = _engine(lora_base, num_kv_blocks=3 * pages + 6, max_loras=2, max_num_seqs=4, max_cpu_loras=3)
    assert _tokens(small, prompts, per_prompt) == alone
    s = small.stats()
    assert s["lora_evictions"] > 0 and s["lora_cpu_evictions"] > 0 and s["lora_adapters_cpu"] <= 3
    _no_leak(small)
    assert _tokens(small, prompts, per_prompt) == alone  # a second round over the same pool
    s = small.stats()
    assert s["lora_pool_loads"] > len(loras) and s["lora_loads"] > len(loras)  # paged in and read again
    _no_leak(small)


def test_a_hundred_adapters_with_room_for_a_few_fail_no_request(lora_base, tmp_path):
    paths = [write_random_adapter(tmp_path / f"h{i}", lora_base, rank=2, std=0.2, seed=i) for i in range(100)]
    loras = [LoRARequest(f"h{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    rng = np.random.default_rng(0)
    picks = [loras[int(i)] for i in rng.integers(0, 100, 120)]
    prompts = [_prompt(j, n=6) for j in range(120)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm = _engine(lora_base, num_kv_blocks=40, max_loras=4, max_cpu_loras=6, max_num_seqs=8)
    outs = llm.generate(prompts, params, lora_request=picks)
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 2 for o in outs)
    s = llm.stats()
    assert s["lora_loads"] >= len({p.lora_int_id for p in picks}) and s["lora_adapters_cpu"] <= 6
    assert s["lora_evictions"] > 0 and s["num_requests_waiting_for_lora"] == 0
    _no_leak(llm)
    check = [0, 1, 2, 119]  # a few against the same requests alone, in a pool that holds every adapter
    ref = _engine(lora_base, num_kv_blocks=256, max_loras=4)
    for j in check:
        assert outs[j].outputs[0].token_ids == _tokens(ref, [prompts[j]], picks[j], params)[0]


def test_a_request_waiting_for_its_adapter_does_not_stall_the_others(lora_base, adapters):
    a = LoRARequest("slow", 1, str(adapters[1]))
    want_a = _tokens(_engine(lora_base, num_kv_blocks=64), [_prompt(0)], a)[0]
    llm = _engine(lora_base, num_kv_blocks=64)
    want_base = _tokens(llm, [_prompt(1)], None)[0]
    engine = llm.engine
    cache = engine.runner.lora_manager.cpu_cache
    release, started = threading.Event(), threading.Event()
    load = cache._load

    def slow_load(request):
        started.set()
        assert release.wait(30)
        return load(request)

    cache._load = slow_load
    slow = engine.add_request(_prompt(0), PARAMS, lora_request=a)
    fast = engine.add_request(_prompt(1), PARAMS)
    done = {}
    while fast not in done:  # the base request runs to its end while the adapter is being read
        done.update({o.request_id: o for o in engine.step() if o.finished})
        started.wait(30)  # the loader thread has the adapter (on a busy machine it may start late)
    assert started.is_set() and slow not in done
    assert done[fast].outputs[0].token_ids == want_base
    s = llm.stats()
    assert s["num_requests_waiting_for_lora"] == 1 and s["lora_loading"] == 1 and s["lora_adapters_resident"] == 0
    assert engine.requests[slow].seqs[0].status is SequenceStatus.WAITING_FOR_LORA
    release.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[slow].outputs[0].token_ids == want_a
    assert llm.stats()["num_requests_waiting_for_lora"] == 0
    _no_leak(llm)


def test_a_failed_background_load_fails_its_requests_alone(lora_base, adapters, tmp_path):
    path = write_random_adapter(tmp_path / "gone", lora_base, rank=4, seed=3)
    llm = _engine(lora_base, num_kv_blocks=64)
    engine = llm.engine
    cache = engine.runner.lora_manager.cpu_cache

    def vanished(request):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: adapter_model.safetensors not found")

    cache._load = vanished
    bad = engine.add_request(_prompt(0), PARAMS, lora_request=LoRARequest("gone", 5, str(path)))
    good = engine.add_request(_prompt(1), PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "not found" in done[bad].error and done[good].error is None
    _no_leak(llm)


def test_max_cpu_loras_below_max_loras_is_refused(lora_base):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _engine(lora_base, max_loras=4, max_cpu_loras=2)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8"])
def test_pool_pages_are_the_pools_blocks_and_hold_an_adapter_bit_for_bit(lora_base, adapters, kv_cache_dtype):
    """A page is a block's bytes in every K and V tensor (a quantized cache's scales included), as many as
    ``kv_block_bytes`` counts; an adapter written across pages reads back unchanged, in any block order."""
    mc = ModelConfig.from_dict(json.loads((lora_base / "config.json").read_text()))
    shape = (12, 16, mc.num_key_value_heads, mc.head_dim)
    tensors = [CPUBackend.allocate_kv_cache(shape, kv_cache_dtype) for _ in range(2 * mc.num_hidden_layers)]
    pages = page_store.PoolPages(tensors)
    want = kv_block_bytes(mc.num_hidden_layers, 16, mc.num_key_value_heads, mc.head_dim, kv_cache_dtype)
    assert pages.page_bytes == want
    request = LoRARequest("a", 1, str(adapters[3]))
    model = LoRAModel.from_local_checkpoint(request, mc, 16)
    spec = LoRAAdapterSpec.from_local_checkpoint(request, mc, 16)
    flat = page_store.pack(model)
    assert len(flat) == spec.num_floats
    block_ids = [7, 2, 9, 0, 5, 11, 3, 8, 1, 10, 4, 6][: pages.num_pages(flat.nbytes)]
    assert len(block_ids) > 1
    pages.write(block_ids, flat)
    back = page_store.unpack(pages.read(block_ids, flat.nbytes).view(np.float32), spec)
    assert set(back) == set(model.layers)
    for key, (a, b) in back.items():
        np.testing.assert_array_equal(a, model.layers[key].lora_a)
        np.testing.assert_array_equal(b, model.layers[key].lora_b)
    with pytest.raises(ValueError, match="do not fit"):
        pages.write(block_ids[:-1], flat)


def test_remove_lora_frees_its_pages_and_refuses_while_a_request_uses_it(lora_base, adapters):
    llm = _engine(lora_base, num_kv_blocks=64)
    engine = llm.engine
    a = LoRARequest("a", 1, str(adapters[0]))
    assert engine.add_lora(a) and engine.list_loras() == {1: a}
    first = _tokens(llm, [_prompt(0)], a)
    rid = engine.add_request(_prompt(1), PARAMS, lora_request=a)
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora(1)
    engine.abort_request(rid)
    assert engine.remove_lora(1) and not engine.remove_lora(1) and engine.list_loras() == {}
    assert llm.stats()["num_free_blocks"] == 64 and llm.stats()["lora_adapters_resident"] == 0
    b = LoRARequest("b", 1, str(adapters[2]))  # the id again, for another adapter: its own weights
    assert _tokens(llm, [_prompt(0)], b) != first
    assert _tokens(llm, [_prompt(0)], b) == _tokens(_engine(lora_base, num_kv_blocks=64), [_prompt(0)], b)
    _no_leak(llm)


def test_a_request_whose_kv_and_adapter_pages_exceed_the_pool_is_refused(lora_base, adapters):
    llm = _engine(lora_base, num_kv_blocks=24)
    a = LoRARequest("a", 1, str(adapters[0]))
    pages = _pages(adapters[0], llm.stats()["kv_block_bytes"])
    fits = 16 * (24 - pages)  # tokens of the KV blocks the adapter leaves
    params = SamplingParams(max_tokens=fits - 12, temperature=0.0, ignore_eos=True)
    assert llm.generate([_prompt(0)], params, lora_request=a)[0].finished
    with pytest.raises(ValueError, match=f"with {pages} pages of its LoRA adapter"):
        llm.generate([_prompt(0)], SamplingParams(max_tokens=fits - 11), lora_request=a)
    _no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_adapter_requests_keep_their_tokens_and_pages_come_back(lora_base, many_adapters, mode):
    """Long requests of three adapters in a pool too small for all of them: preempted (by recompute, or
    swapped to a second tier and back), each still gets its tokens alone, and every page returns."""
    loras = [LoRARequest(f"m{i}", i + 1, str(p)) for i, p in enumerate(many_adapters[:3])]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(j, n=20) for j in range(6)]
    per_prompt = [loras[j % 3] for j in range(6)]
    ref = _engine(lora_base, num_kv_blocks=256, max_loras=3)
    alone = [_tokens(ref, [p], lora, params)[0] for p, lora in zip(prompts, per_prompt)]
    pages = _pages(many_adapters[0], ref.stats()["kv_block_bytes"])
    extra = dict(kv_offloading_size=0.01, preemption_mode="swap") if mode == "swap" else {}
    llm = _engine(lora_base, num_kv_blocks=3 * pages + 10, max_loras=3, enable_prefix_caching=False, **extra)
    assert _tokens(llm, prompts, per_prompt, params) == alone
    s = llm.stats()
    assert s["num_preemptions"] > 0
    if mode == "swap":
        assert s["num_swapped_out"] > 0
    _no_leak(llm)
    llm.close()
