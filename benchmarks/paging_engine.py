"""Paged vs contiguous-reservation admission on the real engine, at one small KV budget.

The same ``LLMEngine`` (CPU, default model) runs the same requests three times; only the scheduler's
admission policy changes (``benchmarks.baselines.ReservationAdmission``):

  paged            default: admit when the prompt's blocks fit; blocks are taken as sequences grow,
                   preemption by recompute when the pool runs dry
  reserve-oracle   admit only if ceil((prompt + max_tokens) / block_size) blocks can be reserved up front
                   (Orca-style; max_tokens is the true output length here: ignore_eos)
  reserve-maxlen   admit only if ceil(max_model_len / block_size) blocks can be reserved up front

Reservation is emulated on top of the paged pool (blocks are still allocated on demand, but promised
blocks are held back from admissions), so these policies have the internal/reservation waste of
contiguous reservation but no external fragmentation: an upper bound for real contiguous allocators
(benchmarks/memory_study.py models fragmentation too).

Reports output tok/s (wall clock; on a shared CPU noisy, so also per process CPU-second), output
tokens per engine step (deterministic),
peak and mean running sequences, preemptions, and the fraction of allocated KV slots holding tokens.
Usage: python benchmarks/paging_engine.py [--requests 32 --input-len 64 --output-len 32
       --num-kv-blocks 64 --max-model-len 256 --out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.baselines import ReservationAdmission  # noqa: E402
from rawpaged import LLM, SamplingParams  # noqa: E402

POLICIES = ("paged", "reserve-oracle", "reserve-maxlen")


def make_policy(name: str, engine):
    if name == "paged":
        return None
    if name == "reserve-maxlen":
        return ReservationAdmission(engine.kv_cache_manager, lambda s: engine.max_model_len)
    if name == "reserve-oracle":
        return ReservationAdmission(
            engine.kv_cache_manager,
            lambda s: min(s.num_prompt_tokens + s.sampling_params.max_tokens, engine.max_model_len),
        )
    raise ValueError(name)


def run_policy(llm: LLM, name: str, prompts: list, params: SamplingParams) -> dict:
    eng = llm.engine
    sched = eng.scheduler
    pool = eng.kv_cache_manager.block_pool
    sched.admission_policy = make_policy(name, eng)
    orig = sched.schedule
    rec = {"running": [], "used_blocks": [], "tokens": [], "reserved_blocks": []}
    policy = sched.admission_policy

    def schedule():  # record the batch as it runs (before finished sequences leave)
        out = orig()
        rec["running"].append(len(sched.running))
        rec["used_blocks"].append(pool.num_used_blocks)
        rec["reserved_blocks"].append(pool.num_used_blocks + (policy.outstanding_blocks if policy else 0))
        rec["tokens"].append(sum(s.block_table.num_tokens for s in sched.running))
        return out

    sched.schedule = schedule
    stats = sched.stats
    pre0, steps0, gen0 = stats.num_preemptions, stats.num_steps, stats.num_generation_tokens
    try:
        for p in prompts:
            eng.add_request(p, params)
        t0, c0 = time.perf_counter(), time.process_time()
        while eng.has_unfinished_requests():
            eng.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del sched.schedule
        sched.admission_policy = None
    gen = stats.num_generation_tokens - gen0
    steps = stats.num_steps - steps0
    block_size = eng.kv_cache_manager.block_size
    slots = sum(rec["used_blocks"]) * block_size
    reserved = sum(rec["reserved_blocks"]) * block_size
    assert pool.num_used_blocks == 0, "blocks leaked"
    return {
        "policy": name,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": gen,
        "output_tok_per_s": gen / wall,
        "output_tok_per_cpu_s": gen / cpu,
        "steps": steps,
        "output_tok_per_step": gen / steps,
        "peak_running": max(rec["running"]),
        "mean_running": float(np.mean(rec["running"])),
        "preemptions": stats.num_preemptions - pre0,
        "kv_util_of_allocated": sum(rec["tokens"]) / slots if slots else 0.0,
        "kv_util_of_reserved": sum(rec["tokens"]) / reserved if reserved else 0.0,
        "mean_kv_blocks_allocated": float(np.mean(rec["used_blocks"])),
        "mean_kv_blocks_reserved": float(np.mean(rec["reserved_blocks"])),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the policies (median tok/s reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args(argv)
    load0 = os.getloadavg()

    llm = LLM(
        device="cpu",
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(args.seed)
    prompts = [
        {"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, args.input_len)]} for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # JIT warm-up

    policies = args.policies.split(",")
    runs = {p: [] for p in policies}
    for _ in range(args.repeats):
        for p in policies:
            r = run_policy(llm, p, prompts, params)
            runs[p].append(r)
            print(
                f"  {p:15s} {r['output_tok_per_s']:6.1f} tok/s  {r['steps']} steps  peak {r['peak_running']}",
                flush=True,
            )
    rows = []
    for p in policies:
        best = sorted(runs[p], key=lambda r: r["output_tok_per_s"])[len(runs[p]) // 2]
        rows.append(dict(best, tok_per_s_all=[round(r["output_tok_per_s"], 1) for r in runs[p]]))
    conditions = {
        "model": "SmolLM2-135M-Instruct (default)",
        "device": "cpu",
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": args.block_size,
        "kv_slots": args.num_kv_blocks * args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "requests": args.requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "arrivals": "all at once",
        "sampling": "greedy, ignore_eos",
        "prefix_caching": False,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load0,
    }
    conditions["loadavg_after"] = os.getloadavg()
    head = (
        f"{'policy':15s} {'tok/s':>7s} {'tok/cpu-s':>9s} {'tok/step':>8s} {'steps':>6s} {'peak':>5s} {'mean':>6s} "
        f"{'preempt':>7s} {'util/alloc':>10s} {'util/resv':>9s}"
    )
    print("\n" + head)
    for r in rows:
        print(
            f"{r['policy']:15s} {r['output_tok_per_s']:7.1f} {r['output_tok_per_cpu_s']:9.1f} "
            f"{r['output_tok_per_step']:8.2f} {r['steps']:6d} {r['peak_running']:5d} {r['mean_running']:6.1f} "
            f"{r['preemptions']:7d} "
            f"{100 * r['kv_util_of_allocated']:9.1f}% {100 * r['kv_util_of_reserved']:8.1f}%"
        )
    print(f"load average before/after: {conditions['loadavg_before']} / {conditions['loadavg_after']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"conditions": conditions, "results": rows}
    (out / "paging_engine.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'paging_engine.json'}")
    return report


if __name__ == "__main__":
    main()
