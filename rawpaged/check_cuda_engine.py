"""Device check: the CUDA engine against the CPU engine on randomly initialised models (no downloads).

For the default model's shapes and a larger Llama-like shape (head_dim 128), runs the same greedy
requests on ``device="cpu"`` and ``device="cuda"`` and compares first-step logits (max abs difference)
and generated ids; then times CUDA decode at batch 1 and 32. Writes ``engine_check.json`` to ``--out``.

Usage: ``python -m rawpaged.check_cuda_engine --out DIR`` (exit code 1 if a check fails).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2-135m-shape": dict(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                               head_dim=64, vocab_size=49152),
    "llama-like-head128": dict(num_layers=8, hidden_size=1024, intermediate_size=2816, num_heads=8, num_kv_heads=2,
                               head_dim=128, vocab_size=32000),
}


def _first_logits(llm, prompt_ids):
    eng = llm.engine
    from rawpaged.sequence import Sequence

    seq = Sequence(0, "check", 0, list(prompt_ids), None, None, 0.0)
    seq.block_table = eng.allocator.new_table()
    assert eng.allocator.allocate_slots(seq.block_table, len(prompt_ids))
    logits, _ = eng.runner.execute([(seq, len(prompt_ids))], [])
    eng.allocator.free(seq.block_table)
    return eng.runner.fetch_rows(logits, [0])[0]


def check_shape(name, shape, tmp, rng):
    from rawpaged import LLM, SamplingParams
    from rawpaged.random_model import write_random_model

    model = write_random_model(Path(tmp) / name, seed=0, **shape)
    prompts = [rng.integers(3, 259, int(n)).tolist() for n in (1, 15, 16, 17, 33, 100, 257, 600)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(model), num_kv_blocks=1024, max_model_len=2048, enable_prefix_caching=False)
    cpu = LLM(device="cpu", **kw)
    gpu = LLM(device="cuda", **kw)
    diffs = [float(np.max(np.abs(_first_logits(cpu, p) - _first_logits(gpu, p)))) for p in prompts]
    cpu_ids = [o.outputs[0].token_ids for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    gpu_ids = [o.outputs[0].token_ids for o in gpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    first_div = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(cpu_ids, gpu_ids)]
    timing = {}
    for batch in (1, 32):
        batch_prompts = [{"prompt_token_ids": rng.integers(3, 259, 32).tolist()} for _ in range(batch)]
        gpu.generate(batch_prompts[:1], SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        gpu.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        timing[f"batch{batch}_tok_per_s"] = batch * 64 / (time.perf_counter() - t0)
    stats = gpu.stats()
    return {
        "shape": shape, "max_abs_logit_diff": max(diffs), "per_prompt_logit_diff": diffs,
        "ids_equal": sum(a == b for a, b in zip(cpu_ids, gpu_ids)), "num_prompts": len(prompts),
        "first_divergence": first_div, "blocks_all_free": stats["num_free_blocks"] == stats["num_total_blocks"],
        **timing,
        "ok": max(diffs) < 1e-2 and sum(a == b for a, b in zip(cpu_ids, gpu_ids)) >= len(prompts) - 1
        and stats["num_free_blocks"] == stats["num_total_blocks"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            try:
                results[name] = check_shape(name, shape, tmp, rng)
            except Exception as e:  # report every shape, then fail
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            r = results[name]
            print(f"{name}: ok={r['ok']} " + (f"max|dlogit|={r['max_abs_logit_diff']:.2e} ids_equal="
                                               f"{r['ids_equal']}/{r['num_prompts']} b1={r['batch1_tok_per_s']:.0f} "
                                               f"b32={r['batch32_tok_per_s']:.0f} tok/s" if "error" not in r else r["error"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_check.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
