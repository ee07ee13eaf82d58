"""Prompt logprobs against the float64 reference model (``tests/model_reference.py``): log-softmax at every
prompt position, within 1e-3, for a tiny random model and the default model; the same with chunked
prefill and after a prefix-cache hit (such a request reads no cache); the LM head never runs on more than
``CHUNK_ROWS`` positions at once; generated tokens' logprobs unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from rawpaged import LLM, SamplingParams
from rawpaged.kernels.cpu import logprobs as cpu_logprobs
from rawpaged.model_executor import prompt_logprobs as prompt_logprobs_mod
from tests.model_reference import forward

TOL = 1e-3


def reference_logprobs(model_dir, prompt: list, max_model_len: int) -> np.ndarray:
    """float64 log-softmax ``[len(prompt), vocab]`` of the reference model over ``prompt``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    logits = forward(cfg, weights, prompt, max_model_len)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def check_against_reference(entries, prompt, ref, k):
    """``entries`` (RequestOutput.prompt_logprobs) is None first, then per token: the prompt token first,
    every logprob within TOL of the reference, and ``k`` more ids (or k with the prompt token among them)
    that are the reference's top k up to near-ties."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i]
        x = row[prompt[i]]  # its rank: 1 + the ids above it, up to near-ties
        assert (row > x + TOL).sum() + 1 <= entry[prompt[i]].rank <= (row >= x - TOL).sum()
        entry = {t: lp.logprob for t, lp in entry.items()}
        for t, v in entry.items():
            assert abs(v - row[t]) < TOL, (i, t, v, row[t])
        top = [t for t in entry if t != prompt[i]] if len(entry) == k + 1 else list(entry)
        assert len(top) == k, (i, entry)
        if k:
            kth = np.sort(row)[::-1][k - 1]
            assert all(row[t] >= kth - TOL for t in top), (i, entry)
        rest = [entry[t] for t in entry if t != prompt[i]]
        assert rest == sorted(rest, reverse=True)  # after the prompt token, the top ids in descending order


@pytest.mark.parametrize("k", [0, 1, 5])
def test_tiny_model_prompt_logprobs_match_the_reference(tiny_dir, k):
    prompt = [(13 * i + 5) % 250 + 3 for i in range(70)]
    ref = reference_logprobs(tiny_dir, prompt, 256)
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k))
    check_against_reference(out[0].prompt_logprobs, prompt, ref, k)
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out[0].outputs[0].token_ids


def test_minus_one_prompt_logprobs_are_the_whole_vocabulary(tiny_dir):
    """vLLM's ``prompt_logprobs=-1`` (allowed by ``max_logprobs=-1``): every id of the vocabulary, by the
    CPU kernel's whole-row sort, against the reference."""
    prompt = [(13 * i + 5) % 250 + 3 for i in range(20)]
    ref = reference_logprobs(tiny_dir, prompt, 64)
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64, max_logprobs=-1)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=-1, logprobs=-1))
    check_against_reference(out[0].prompt_logprobs, prompt, ref, ref.shape[1])
    assert [len(e) for e in out[0].outputs[0].logprobs] == [ref.shape[1]]


def test_the_whole_row_sort_orders_as_the_top_k_kernel():
    """Above ``FULL_SORT_K`` the CPU kernel sorts whole rows: the same ids in the same order (descending,
    equal values by lower id) as its top-k selection."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((4, 300)) * 2).astype(np.float32)  # many equal values
    k = cpu_logprobs.FULL_SORT_K + 1
    selected = np.empty((4, k), dtype=np.int64)
    cpu_logprobs._top_k_rows(logits.copy(), k, selected)
    got = cpu_logprobs.logprob_rows(logits.copy(), np.zeros(4, np.int64), k)[2]
    np.testing.assert_array_equal(got, selected)


def test_chunked_prefill_and_prefix_cache_keep_every_prompt_logprob(tiny_dir, monkeypatch):
    """A 16-token step budget splits the prompt into chunks; a second request with the same prompt finds
    it cached but computes it again (num_cached_tokens 0) and gets the same logprobs; one without prompt
    logprobs then hits the cache. The LM head never sees more than CHUNK_ROWS positions at once."""
    monkeypatch.setattr(prompt_logprobs_mod, "CHUNK_ROWS", 8)
    prompt = [(7 * i + 11) % 250 + 3 for i in range(60)]
    ref = reference_logprobs(tiny_dir, prompt, 256)
    llm = LLM(
        model=str(tiny_dir),
        device="cpu",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    model = llm.engine.model
    head = model.compute_logits
    sizes = []
    monkeypatch.setattr(model, "compute_logits", lambda h: sizes.append(h.shape[0]) or head(h))
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    check_against_reference(first.prompt_logprobs, prompt, ref, 2)
    assert max(sizes) <= 16 and max(sizes) <= max(8, 16)  # a step's rows (16) or a chunk (8)
    again = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    hit = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_lm_head_chunks_bound_the_memory(tiny_dir, monkeypatch):
    """One 200-token prefill step: the prompt-logprob LM head calls are at most CHUNK_ROWS positions."""
    monkeypatch.setattr(prompt_logprobs_mod, "CHUNK_ROWS", 32)
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    model = llm.engine.model
    head = model.compute_logits
    sizes = []
    monkeypatch.setattr(model, "compute_logits", lambda h: sizes.append(h.shape[0]) or head(h))
    prompt = [(3 * i + 1) % 250 + 3 for i in range(200)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == 200 and sorted(sizes)[-2:] == [32, 32] and sum(sizes) == 199 + 1


@pytest.mark.model
def test_default_model_prompt_logprobs_match_the_reference(model_dir):
    from rawpaged.tokenizer import Tokenizer

    prompt = Tokenizer(model_dir).encode("The capital of France is Paris. The capital of Italy is Rome.")
    ref = reference_logprobs(model_dir, prompt, 1024)
    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=64, max_model_len=1024)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    check_against_reference(out[0].prompt_logprobs, prompt, ref, 3)
