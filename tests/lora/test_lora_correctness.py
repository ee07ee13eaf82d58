"""LoRA through the engine against float64 references with the merged weight ``W + s * B @ A``: every
prompt position's log-softmax, greedy tokens equal to a model whose merged weights were saved, a batch
mixing adapters and the base model equal to each request alone, the prefix cache keyed by adapter, and
every block returned."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rawpaged import LLM, LoRARequest, SamplingParams
from rawpaged.testing.random_lora import merged_weights, write_random_adapter
from tests.model_reference import decisive_prefix, forward, greedy_reference

MAX_LEN = 256
PROMPTS = [[(7 * i + 3 * j + 5) % 250 + 3 for i in range(10 + 3 * j)] for j in range(5)]
MAX_TOKENS = 12


def _weights(model_dir) -> dict:
    return load_file(str(model_dir / "model.safetensors"))


def _cfg(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _engine(model_dir, **kw):
    kw.setdefault("num_kv_blocks", 64)
    return LLM(model=str(model_dir), device="cpu", max_model_len=MAX_LEN, **kw)


def _greedy(llm, prompts, lora=None) -> list:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def _request(i, path) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i + 1, str(path))


def _all_returned(llm) -> None:
    """Every KV block back; what stays used is the idle adapters' pages (no running user)."""
    s = llm.stats()
    pages = llm.engine.kv_cache_manager.adapter_pages
    assert s["num_used_blocks"] == s["lora_adapter_pages"] == pages.num_idle_pages
    assert s["num_free_blocks"] + s["num_used_blocks"] == s["num_total_blocks"]
    llm.engine.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("rank", [8, 64])
def test_prompt_logprobs_match_the_merged_float64_reference(lora_base, tmp_path, rank):
    adapter = write_random_adapter(tmp_path / "a", lora_base, rank=rank, lora_alpha=2.0 * rank, std=0.1, seed=rank)
    prompt = PROMPTS[4]
    logits = forward(_cfg(lora_base), merged_weights(_weights(lora_base), adapter), prompt, MAX_LEN)
    ref = logits - logits.max(1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    base = forward(_cfg(lora_base), _weights(lora_base), prompt, MAX_LEN)
    assert np.abs(logits - base).max() > 0.1  # the adapter changes the logits well beyond the tolerance
    llm = _engine(lora_base, enable_lora=True, max_lora_rank=64, max_logprobs=-1, num_kv_blocks=160)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(adapter)))[0]
    got = np.full_like(ref[:-1], np.nan)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        for t, lp in entry.items():
            got[i, t] = lp.logprob
    np.testing.assert_allclose(got, ref[:-1], atol=1e-4)
    _all_returned(llm)


def _save_merged(src, adapter, dst):
    """A new HF directory of ``src`` with ``adapter`` merged into its weights (float32)."""
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    merged = {k: np.asarray(v, np.float32) for k, v in merged_weights(_weights(src), adapter).items()}
    save_file(merged, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_greedy_tokens_equal_the_merged_and_saved_model(lora_base, adapters, tmp_path):
    lora_llm = _engine(lora_base, enable_lora=True)
    for i, adapter in enumerate(adapters):
        merged_dir = _save_merged(lora_base, adapter, tmp_path / f"merged{i}")
        want = _greedy(_engine(merged_dir), PROMPTS)
        got = _greedy(lora_llm, PROMPTS, _request(i, adapter))
        cfg, w = _cfg(merged_dir), _weights(merged_dir)
        checked = 0
        for j, prompt in enumerate(PROMPTS):  # up to the first near-tie of the float64 reference
            ref, margins = greedy_reference(cfg, w, prompt, MAX_TOKENS, MAX_LEN)
            k = decisive_prefix(ref, margins, 1e-3)
            assert want[j][:k] == ref[:k] and got[j][:k] == ref[:k], (i, j)
            checked += k
        assert checked >= len(PROMPTS) * MAX_TOKENS // 2, i  # enough decisive steps to test anything
        assert got != _greedy(lora_llm, PROMPTS)  # and the adapter changes the tokens
    _all_returned(lora_llm)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_a_batch_of_four_adapters_and_the_base_model_gives_each_its_tokens_alone(lora_base, adapters, max_loras):
    """Five prompts, four adapters and the base model, in one generate (max_loras 2: the scheduler admits
    two adapters at a time and slots are reused); each equals its request run alone."""
    llm = _engine(lora_base, enable_lora=True, max_loras=max_loras, enable_prefix_caching=False)
    loras = [_request(i, a) for i, a in enumerate(adapters)] + [None]
    alone = [_greedy(llm, [p], lora)[0] for p, lora in zip(PROMPTS, loras)]
    batched = _greedy(llm, PROMPTS, loras)
    assert batched == alone
    assert len({tuple(t) for t in alone}) == len(alone)  # five different outputs: every adapter ran
    manager = llm.engine.runner.lora_manager
    assert len(manager.resident) <= max_loras
    _all_returned(llm)


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(lora_base, adapters):
    prompt = [(5 * i + 1) % 250 + 3 for i in range(50)]  # three full blocks of 16 before the last token
    a, b = _request(0, adapters[0]), _request(1, adapters[1])
    fresh = {lora: _greedy(_engine(lora_base, enable_lora=True), [prompt], lora)[0] for lora in (a, b, None)}
    llm = _engine(lora_base, enable_lora=True, max_loras=2)
    hits = []
    for lora in (a, b, None, a, b, None):
        before = llm.stats()["prefix_cache_hits"]
        assert _greedy(llm, [prompt], lora)[0] == fresh[lora]
        hits.append(llm.stats()["prefix_cache_hits"] - before)
    assert hits == [0, 0, 0, 3, 3, 3]  # each adapter (and the base) finds its own blocks only
    _all_returned(llm)


def test_a_shared_prompt_in_one_batch_shares_blocks_within_an_adapter_only(lora_base, adapters):
    prompt = [(5 * i + 1) % 250 + 3 for i in range(50)]
    a, b = _request(0, adapters[0]), _request(1, adapters[1])
    llm = _engine(lora_base, enable_lora=True, max_loras=2)
    _greedy(llm, [prompt], a)  # cached under adapter a
    before = llm.stats()["prefix_cache_hits"]
    got = _greedy(llm, [prompt, prompt, prompt], [b, a, b])
    # a's request hits its 3 blocks; b's first computes its own, which b's second (same step) cannot see yet
    assert llm.stats()["prefix_cache_hits"] - before == 3
    assert got[0] == got[2] != got[1]
    _all_returned(llm)


def test_on_q8_0_weights_the_adapter_is_added_beside_the_quantized_linears(tmp_path):
    """A base quantized to Q8_0 on load keeps its blocks; with an adapter its log-softmax is the float64
    merged reference's within Q8_0's error, far closer than the base alone's."""
    from rawpaged.testing.random_model import write_random_model

    shape = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    base = write_random_model(tmp_path / "q8base", seed=3, weight_std=0.08, **shape)
    adapter = write_random_adapter(tmp_path / "a", base, rank=8, std=0.1, seed=5)
    prompt = PROMPTS[3]

    def log_softmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    ref = log_softmax(forward(_cfg(base), merged_weights(_weights(base), adapter), prompt, MAX_LEN))[:-1]
    plain = log_softmax(forward(_cfg(base), _weights(base), prompt, MAX_LEN))[:-1]
    llm = _engine(base, enable_lora=True, quantization="q8_0", max_logprobs=-1)
    assert not isinstance(llm.engine.model.layers[0]["qkv_proj"], np.ndarray)  # still Q8_0 blocks, not merged
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(adapter)))[0]
    got = np.array([[entry[t].logprob for t in range(ref.shape[1])] for entry in out.prompt_logprobs[1:]])
    err, effect = np.abs(got - ref).max(), np.abs(plain - ref).max()
    assert err < 0.1 * effect, (err, effect)
    _all_returned(llm)


def test_lora_steps_run_op_by_op_and_base_steps_keep_the_fused_decode(lora_base, adapters, monkeypatch):
    llm = _engine(lora_base, enable_lora=True)
    fused = llm.engine.runner.fused_decode
    calls = []
    forward_step = fused.forward_step
    monkeypatch.setattr(fused, "forward_step", lambda step: calls.append(step) or forward_step(step))
    _greedy(llm, PROMPTS[:1])
    assert calls  # the base model's decode steps: one compiled call
    _greedy(llm, PROMPTS[:1], _request(0, adapters[0]))  # loaded: the next batch admits both at once
    calls.clear()
    _greedy(llm, PROMPTS[:2], [_request(0, adapters[0]), None])
    assert not calls  # any adapter token in a step: op by op


def test_parallel_samples_keep_their_requests_adapter(lora_base, adapters):
    llm = _engine(lora_base, enable_lora=True)
    lora = _request(2, adapters[2])
    want = _greedy(llm, PROMPTS[:1], lora)[0]
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, lora_request=lora)[0]
    assert [o.token_ids for o in out.outputs] == [want] * 3  # forks run with the adapter too
    _all_returned(llm)


def test_the_second_tiers_blocks_carry_the_adapter_across_a_restart(lora_base, adapters, tmp_path):
    """Blocks written through to a persistent tier under adapter a: after a restart, adapter b and the base
    model with the same prompt find none of them, adapter a (same files, same digest) all three."""
    prompt = [(5 * i + 1) % 250 + 3 for i in range(50)]
    a, b = _request(0, adapters[0]), _request(1, adapters[1])
    kw = dict(enable_lora=True, max_loras=2, kv_offloading_size=0.01, kv_offload_dir=str(tmp_path / "tier"))
    first = _engine(lora_base, **kw)
    want = _greedy(first, [prompt], a)[0]
    assert first.stats()["kv_offload"]["prefix_stores"] >= 3
    first.close()
    again = _engine(lora_base, **kw)
    for lora, hits in ((b, 0), (None, 0), (a, 3)):
        before = again.stats()["offload_prefix_hits"]
        out = _greedy(again, [prompt], lora)[0]
        assert again.stats()["offload_prefix_hits"] - before == hits, lora
    assert out == want
    _all_returned(again)
    again.close()
