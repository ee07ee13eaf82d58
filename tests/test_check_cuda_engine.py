"""``rawpaged.tools.check_cuda_engine.classify_divergences``, the device check's rule for greedy equality up to
near-ties, on the CPU engine (no GPU): equal outputs, and a divergence that is a near-tie or not by the
CPU's top-2 gap at the differing step."""

from __future__ import annotations

import numpy as np

from rawpaged import LLM, SamplingParams
from rawpaged.tools.check_cuda_engine import _first_logits, classify_divergences


def test_divergences_are_judged_by_the_cpus_top2_gap(tiny_dir):
    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    step = np.asarray(_first_logits(llm, prompts[1] + ids[1][:2]), dtype=np.float64)
    second = int(np.argsort(step)[-2])
    assert int(np.argmax(step)) == ids[1][2]
    other = [ids[0], ids[1][:2] + [second, 1, 1, 1]]  # another device picked the runner-up at step 2
    gap = float(np.sort(step)[-1] - np.sort(step)[-2])
    scale = float(np.max(np.abs(step)))

    same = classify_divergences(llm, prompts, ids, ids)
    assert (same["equal"], same["near_ties"], same["divergences"]) == (2, 0, 0)
    strict = classify_divergences(llm, prompts, ids, other, relative=0.5 * gap / scale)
    assert (strict["equal"], strict["near_ties"], strict["divergences"]) == (1, 0, 1)
    assert strict["per_prompt"][1] == {"index": 2, "top2_gap": gap, "near_tie": False}
    loose = classify_divergences(llm, prompts, ids, other, relative=2 * gap / scale)
    assert (loose["near_ties"], loose["divergences"]) == (1, 0) and loose["per_prompt"][0] is None
    shorter = classify_divergences(llm, prompts, ids, [ids[0], ids[1][:4]], relative=0.0)  # stopped early
    assert shorter["per_prompt"][1]["index"] == 4 and shorter["divergences"] == 1


def test_the_gpu_check_script_names_known_shapes_and_every_moe_shape():
    """scripts/gpu_check.sh's ``--shapes`` lists exist in the engine check (a typo would cost a device
    session), and its MoE stage runs every random mixture of experts."""
    import re
    from pathlib import Path

    from rawpaged.tools.check_cuda_engine import ALL_SHAPES, MOE_CHECK_SHAPES

    text = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh").read_text()
    named = [n for arg in re.findall(r"--shapes\s+(\S+)", text) for n in arg.split(",")]
    assert named and set(named) <= set(ALL_SHAPES)
    moe = re.search(r"run_stage engine-moe .*?--shapes\s+(\S+)", text, re.S).group(1).split(",")
    assert set(moe) == set(MOE_CHECK_SHAPES) and len(MOE_CHECK_SHAPES) == 3
    assert {s["architecture"] for s in MOE_CHECK_SHAPES.values()} == {
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    }
