"""The engine's features on a tiny random mixture of experts (Qwen2-MoE: shared expert, dense and sparse
layers): int8 KV cache, ngram and suffix speculative decoding, swapping to the second KV tier and the
server give the tokens the plain engine gives, and structured output holds its constraint (prefix
caching, batching and preemption by recompute: ``tests/model_executor/test_moe.py``)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.testing.random_model import MOE_SHAPES, write_random_model

_rng = np.random.default_rng(7)
#: a repetitive prompt (ngram drafts find matches), a random one and a shorter one
PROMPTS = [[5, 6, 7, 8, 9] * 5, [int(t) for t in _rng.integers(3, 259, 17)], [40, 41, 42, 40, 41, 42, 40]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("moe") / "qwen2moe", weight_std=0.15, **MOE_SHAPES["Qwen2MoeForCausalLM"]
    )


def _greedy(llm, prompts=PROMPTS):
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _all_returned(llm):
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.fixture(scope="module")
def plain(moe_dir):
    return _greedy(LLM(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4))


def test_int8_kv_cache_batched_equals_one_at_a_time(moe_dir):
    llm = LLM(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4, kv_cache_dtype="int8",
              enable_prefix_caching=True)  # fmt: skip
    assert type(llm.engine.runner.key_caches[0]).__name__ == "QuantizedKVCache"
    one = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert _greedy(llm, PROMPTS) == one
    _all_returned(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_keeps_the_greedy_tokens(moe_dir, plain, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    llm = LLM(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4, speculative_config=spec)
    assert _greedy(llm) == plain
    stats = llm.stats()
    assert stats["spec_decode"]["num_drafts"] > 0
    _all_returned(llm)


def test_swapping_to_the_second_tier_gives_the_unpressured_tokens(moe_dir, plain):
    """A pool too small for the batch, preemption by swapping to the host tier: the tokens of the run with
    room, every swapped block back, the tier empty at the end."""
    llm = LLM(model=str(moe_dir), device="cpu", num_kv_blocks=14, block_size=4, kv_offloading_size=0.01,
              preemption_mode="swap", enable_prefix_caching=False)  # fmt: skip
    assert _greedy(llm) == plain
    stats = llm.stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    _all_returned(llm)
    assert llm.engine.scheduler.kv_tier.manager.num_swap_blocks == 0
    llm.close()


def test_structured_output_holds_its_constraint(moe_dir):
    from rawpaged.sampling_params import StructuredOutputsParams

    llm = LLM(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4)
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out in outs:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    _all_returned(llm)


def test_the_server_completes_with_the_engines_tokens(moe_dir, plain):
    pytest.importorskip("pydantic")
    aiohttp = pytest.importorskip("aiohttp")
    from rawpaged.config import EngineConfig
    from tests.entrypoints.server_thread import served

    async def complete(url):
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    config = EngineConfig(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4, max_model_len=128)
    with served(config) as srv:
        out = asyncio.run(complete(srv.url))
    llm = LLM(model=str(moe_dir), device="cpu", num_kv_blocks=64, block_size=4)
    want = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)[0].outputs[0]
    assert out["choices"][0]["text"] == want.text
    assert out["usage"]["completion_tokens"] == 12 and list(want.token_ids) == plain[1]
