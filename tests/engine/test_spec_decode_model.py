"""Speculative decoding on the real default model: the 6 recorded reference prompts (HF transformers'
greedy ids) come out the same with each method, apart from near-ties under the CUDA check's rule
(``classify_divergences``); the model drafting for itself is accepted almost always."""

import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.tools.check_cuda_engine import classify_divergences

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        {"method": "suffix", "num_speculative_tokens": 6},
        {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "suffix", "draft_model"],
)
def test_reference_prompts_keep_their_greedy_ids(model_dir, llm, reference_greedy, spec):
    refs = reference_greedy["prompts"]
    if spec.get("model") == "SELF":
        spec = dict(spec, model=str(model_dir))
    fast = LLM(model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=1024, speculative_config=spec)
    prompts = [r["prompt_token_ids"] for r in refs]
    got = [o.outputs[0].token_ids for o in fast.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    want = [r["output_token_ids"] for r in refs]
    verdict = classify_divergences(llm, prompts, want, got)
    assert verdict["divergences"] == 0, verdict
    assert verdict["equal"] + verdict["near_ties"] == len(refs)
    stats = fast.stats()
    assert stats["spec_decode"]["num_drafts"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    if spec["method"] == "draft_model":
        assert stats["spec_decode"]["acceptance_rate"] >= 0.95, stats["spec_decode"]
