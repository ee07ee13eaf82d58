"""Block sharing on the real model: parallel sampling forks, beam search against HF transformers, and
automatic prefix caching (greedy output identical with caching on and off; no stale hits)."""

import json

import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.core.prefix_cache import find_longest_cache_hit
from tests.conftest import FIXTURES

pytestmark = pytest.mark.model


def _assert_pool_empty(llm):
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    llm.engine.kv_cache_manager.check_invariants()


def test_n4_holds_prompt_blocks_once(llm):
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(2000, 2040))}  # 2 full blocks + 8 tokens
    rid = eng.add_request(prompt, SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True))
    eng.step()  # prefill once, then fork into 4 sequences
    seqs = eng.requests[rid].seqs
    assert len(seqs) == 4
    assert llm.stats()["prompt_tokens_total"] >= 40
    full_blocks = seqs[0].block_table.block_ids[:2]
    for s in seqs:
        assert s.block_table.block_ids[:2] == full_blocks
    pool = eng.kv_cache_manager.block_pool
    assert [pool.blocks[b].ref_count for b in full_blocks] == [4, 4]
    cow_before = pool.num_cow_copies
    eng.step()  # each sequence writes into the shared partial block: copy-on-write for all but one
    assert pool.num_cow_copies - cow_before == 3
    assert [pool.blocks[b].ref_count for b in full_blocks] == [4, 4]
    while eng.has_unfinished_requests():
        eng.step()
    _assert_pool_empty(llm)


def test_best_of_returns_n_best_by_logprob(llm):
    out = llm.generate(
        ["The weather today is"], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=6, logprobs=0)
    )[0]
    assert len(out.outputs) == 2 and [o.index for o in out.outputs] == [0, 1]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    _assert_pool_empty(llm)


def test_beam_search_matches_hf(llm):
    ref = json.loads((FIXTURES / "reference_beam.json").read_text())
    args = ref["generate_args"]
    for p in ref["prompts"]:
        out = llm.beam_search(
            [{"prompt_token_ids": p["prompt_token_ids"]}],
            beam_width=args["num_beams"],
            max_tokens=args["max_new_tokens"],
            length_penalty=args["length_penalty"],
        )[0]
        assert [o.token_ids for o in out.outputs] == [b["output_token_ids"] for b in p["beams"]], p["name"]
        for o, b in zip(out.outputs, p["beams"]):
            assert o.cumulative_logprob / len(o.token_ids) == pytest.approx(b["sequence_score"], abs=1e-3)
    assert llm.stats()["num_cow_copies"] > 0
    _assert_pool_empty(llm)


def _prompts_sharing(base, blocks_shared, bs=16):
    """Two prompts whose first ``blocks_shared`` blocks are identical, then different tails."""
    a = base[: blocks_shared * bs] + [3000 + i for i in range(20)]
    b = base[: blocks_shared * bs] + [4000 + i for i in range(23)]
    return a, b


@pytest.mark.parametrize("blocks_shared", [0, 1, 2])
def test_prefix_caching_greedy_equal_to_off(model_dir, blocks_shared):
    base = list(range(500, 564))
    a, b = _prompts_sharing(base, blocks_shared)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    off = LLM(model=str(model_dir), device="cpu", num_kv_blocks=128, max_model_len=512, enable_prefix_caching=False)
    on = LLM(model=str(model_dir), device="cpu", num_kv_blocks=128, max_model_len=512)
    expect = [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params)]
    # One after another: the second finds the first's blocks.
    seq_a = on.generate([{"prompt_token_ids": a}], params)[0]
    seq_b = on.generate([{"prompt_token_ids": b}], params)[0]
    assert [seq_a.outputs[0].token_ids, seq_b.outputs[0].token_ids] == expect
    assert seq_b.num_cached_tokens == blocks_shared * 16
    # Concurrently, and resent verbatim (a fully cached block-aligned prompt still computes its last token).
    both = on.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params)
    assert [o.outputs[0].token_ids for o in both] == expect
    aligned = base[:48]
    ref = off.generate([{"prompt_token_ids": aligned}], params)[0].outputs[0].token_ids
    first = on.generate([{"prompt_token_ids": aligned}], params)[0]
    again = on.generate([{"prompt_token_ids": aligned}], params)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref
    assert again.num_cached_tokens == 32  # 3 full blocks cached, the last one recomputed
    _assert_pool_empty(on)
    _assert_pool_empty(off)


def test_evicted_block_gives_no_stale_hit(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    on = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, max_model_len=128)
    off = LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, max_model_len=128, enable_prefix_caching=False)
    old = list(range(700, 740))
    on.generate([{"prompt_token_ids": old}], params)
    assert on.stats()["num_cached_blocks"] == 2
    # Fill the whole pool with other tokens: every cached block is evicted and overwritten.
    on.generate([{"prompt_token_ids": list(range(900, 1010))}], SamplingParams(max_tokens=8, ignore_eos=True))
    assert find_longest_cache_hit(on.engine.kv_cache_manager.block_pool, old, 16, max_blocks=2) == ([], 1)
    again = on.generate([{"prompt_token_ids": old}], params)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == off.generate([{"prompt_token_ids": old}], params)[0].outputs[0].token_ids
    _assert_pool_empty(on)
