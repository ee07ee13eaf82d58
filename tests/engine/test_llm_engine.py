"""The engine on the real default model: greedy ids against HF transformers' recorded ids, batching
invariance, preemption under a tiny pool, sampling semantics, and every block back at the end."""

import pytest

from rawpaged import LLM, SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
EXTRA_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
]


def _assert_pool_empty(llm):
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    llm.engine.kv_cache_manager.check_invariants()


def test_greedy_matches_hf_reference_batched_and_alone(llm, reference_greedy):
    refs = reference_greedy["prompts"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in refs] + EXTRA_PROMPTS
    together = llm.generate(prompts, GREEDY)
    for ref, out in zip(refs, together):
        assert out.outputs[0].token_ids == ref["output_token_ids"], ref["name"]
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], GREEDY)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    _assert_pool_empty(llm)


def test_first_step_logprobs_match_reference(llm, reference_greedy):
    ref = reference_greedy["prompts"][0]
    out = llm.generate(
        [{"prompt_token_ids": ref["prompt_token_ids"]}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    )[0]
    got = out.outputs[0].logprobs[0]
    for item in ref["first_step_top5"]:
        assert got[item["token_id"]] == pytest.approx(item["logprob"], abs=2e-3)


def test_french_capital_chat(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0.0, max_tokens=20)
    )[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2


def test_tiny_pool_preempts_and_matches_large_pool(model_dir, llm, reference_greedy):
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reference_greedy["prompts"]] + EXTRA_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    longest = max(len(llm.generate([p], SamplingParams(max_tokens=1))[0].prompt_token_ids) for p in prompts)
    need = -(-(longest + 24) // 16)
    small = LLM(
        model=str(model_dir), device="cpu", num_kv_blocks=need + 3, max_model_len=1024, enable_prefix_caching=False
    )
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert got == expected
    assert small.stats()["num_preemptions"] > 0
    _assert_pool_empty(small)


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Tell me a story about a cat."], params)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Tell me a story about a cat.", "Hello", "1 2 3 4"],
        [params, SamplingParams(temperature=1.0, max_tokens=8), SamplingParams(temperature=1.0, max_tokens=5)],
    )
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = llm.generate(
        ["Tell me a story about a cat."],
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=12, ignore_eos=True),
    )[0]
    assert other_seed.outputs[0].token_ids != alone


def test_max_tokens_one_and_length_finish(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_stop_string_spanning_tokens_is_cut(llm):
    # Greedy continuation is " Emma who loved to play in the sun. ..."; "o lov" spans "who" and " loved".
    prompt = "Once upon a time, there was a little girl named"
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].text
    assert full.startswith(" Emma who loved")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop=["o lov"]))[0].outputs[0]
    assert out.text == " Emma wh" and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[10251]))[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    _assert_pool_empty(llm)


def test_n_samples_share_prompt_blocks_and_differ(llm):
    params = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 40 tokens: 2 full blocks + 8
    a = llm.generate([prompt], params)[0]
    b = llm.generate([prompt], params)[0]
    ids = [tuple(o.token_ids) for o in a.outputs]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert len(set(ids)) == 4, "seeded samples must differ from each other"
    assert ids == [tuple(o.token_ids) for o in b.outputs], "and be reproducible"
    _assert_pool_empty(llm)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(stop=[1, 2]), "stop"),
        (dict(logprobs=-2), "logprobs"),
        (dict(seed="x"), "seed"),
    ],
)
def test_bad_sampling_params(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_requests_are_rejected_and_nothing_leaks(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 1024}])
    with pytest.raises(ValueError, match="outside"):
        llm.generate([{"prompt_token_ids": [5, 49152]}])
    _assert_pool_empty(llm)
    assert not llm.engine.has_unfinished_requests()


def test_request_too_big_for_empty_pool(model_dir):
    small = LLM(model=str(model_dir), device="cpu", num_kv_blocks=4, max_model_len=1024)
    with pytest.raises(ValueError, match=r"needs 6 KV blocks .* only 4"):
        small.generate([{"prompt_token_ids": [5] * 80}], SamplingParams(max_tokens=10))
    assert small.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=4))[0].outputs[0].token_ids
    _assert_pool_empty(small)


def test_abort_returns_blocks(llm):
    eng = llm.engine
    rid = eng.add_request("Write a long essay about the sea.", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert llm.stats()["num_used_blocks"] > 0
    assert eng.abort_request(rid)
    assert not eng.abort_request(rid)
    _assert_pool_empty(llm)


def test_chunked_prefill_matches_whole_prefill(model_dir, llm, reference_greedy):
    ref = max(reference_greedy["prompts"], key=lambda r: len(r["prompt_token_ids"]))  # ~100 tokens
    chunked = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=24)
    out = chunked.generate([{"prompt_token_ids": ref["prompt_token_ids"]}], GREEDY)[0]
    assert out.outputs[0].token_ids == ref["output_token_ids"]
    assert chunked.stats()["num_steps"] > len(ref["output_token_ids"]) + 1  # the prompt took several steps
