"""What block sharing saves, on the default model (CPU backend), measured side by side in one run.

1. Parallel sampling n = 1, 2, 4, 8 and beam search (width 4) on one ``--prompt-len``-token prompt with
   ``--output-len`` generated tokens: peak KV blocks in use and output tok/s, with sharing (forks share
   blocks copy-on-write) vs the same engine whose forks copy every block (``benchmarks.baselines.CopyingForks``).
2. Prefix caching: requests that share a ``--system-len``-token system prompt followed by a distinct
   ``--user-len``-token question, sent one after another; TTFT with ``enable_prefix_caching`` on vs off.

Usage: ``python benchmarks/sharing.py [--prompt-len 512] [--output-len 128] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.baselines import CopyingForks  # noqa: E402
from benchmarks.common import conditions, print_table, write_json  # noqa: E402
from rawpaged import LLM, SamplingParams  # noqa: E402
from rawpaged import weights as rp_weights  # noqa: E402


def run_forks(model_dir, prompt, output_len, share, kind, n):
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        num_kv_blocks=2048,
        max_model_len=2048,
        enable_prefix_caching=False,
        max_num_seqs=16,
    )
    if not share:
        kv = llm.engine.kv_cache_manager
        llm.engine.scheduler.kv_cache_manager = CopyingForks(kv.num_blocks, kv.block_size, kv.enable_prefix_caching)
    if kind == "beam":
        params = SamplingParams(n=n, beam_width=n, max_tokens=output_len, ignore_eos=True)
    else:
        params = SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:20]}], SamplingParams(max_tokens=2))  # JIT and BLAS warm-up
    llm.engine.kv_cache_manager.reset_stats()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    elapsed = time.perf_counter() - t0
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    generated = sum(len(o.token_ids) for o in out.outputs) if kind != "beam" else n * output_len
    return dict(
        case=f"{kind} {n}",
        sharing="on" if share else "off",
        peak_blocks=s["peak_used_blocks"],
        peak_kv_MiB=s["peak_used_blocks"] * llm.engine.kv_block_bytes / 2**20,
        cow_copies=s["num_cow_copies"],
        output_tok_per_s=generated / elapsed,
    )


def run_prefix(model_dir, system, questions, caching):
    llm = LLM(model=str(model_dir), device="cpu", num_kv_blocks=1024, max_model_len=2048, enable_prefix_caching=caching)
    llm.generate([{"prompt_token_ids": system + [13, 14]}], SamplingParams(max_tokens=1))  # warm-up + cache fill
    ttfts, cached = [], []
    for q in questions:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": system + q}], SamplingParams(temperature=0.0, max_tokens=1))[0]
        ttfts.append(time.perf_counter() - t0)
        cached.append(out.num_cached_tokens)
    return dict(
        prefix_caching="on" if caching else "off",
        ttft_ms_mean=1e3 * statistics.mean(ttfts),
        ttft_ms_p50=1e3 * statistics.median(ttfts),
        cached_tokens_per_request=statistics.mean(cached),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--num-questions", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    model_dir = rp_weights.prepare(progress=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 49152, args.prompt_len).tolist()
    rows = []
    cases = [("sample", n) for n in args.ns] + [("beam", args.beam_width)]
    for kind, n in cases:
        for share in (True, False):
            rows.append(run_forks(model_dir, prompt, args.output_len, share, kind, n))
    by = {(r["case"], r["sharing"]): r for r in rows}
    for r in rows:
        r["blocks_vs_no_sharing"] = r["peak_blocks"] / by[(r["case"], "off")]["peak_blocks"]
    print_table(
        rows,
        ["case", "sharing", "peak_blocks", "peak_kv_MiB", "blocks_vs_no_sharing", "cow_copies", "output_tok_per_s"],
    )
    system = rng.integers(100, 49152, args.system_len).tolist()
    questions = [rng.integers(100, 49152, args.user_len).tolist() for _ in range(args.num_questions)]
    prefix_rows = [run_prefix(model_dir, system, questions, c) for c in (True, False)]
    prefix_rows[0]["ttft_speedup"] = prefix_rows[1]["ttft_ms_mean"] / prefix_rows[0]["ttft_ms_mean"]
    print()
    print_table(
        prefix_rows, ["prefix_caching", "ttft_ms_mean", "ttft_ms_p50", "cached_tokens_per_request", "ttft_speedup"]
    )
    write_json(
        Path(args.out) / "sharing.json",
        {
            "conditions": conditions(
                model="SmolLM2-135M-Instruct",
                dtype="float32",
                block_size=16,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                sampling="temperature 0.8 seed 0, ignore_eos; beam search greedy",
                system_len=args.system_len,
                user_len=args.user_len,
            ),
            "forks": rows,
            "prefix_caching": prefix_rows,
        },
    )


if __name__ == "__main__":
    main()
