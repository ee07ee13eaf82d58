"""KV memory beyond paging, measured side by side with float32 KV in one run (default model, CPU backend).

Section ``quant`` (``--kv-cache-dtype int8`` / ``fp8_e4m3`` against float32):

1. Bytes per token (all layers, K and V, scales included) and how many 2K-token sequences fit in 1 GiB.
2. Teacher-forced accuracy: greedy continuations of ``--prompts`` prompts, ``--tokens`` tokens each, are
   made once with float32 KV; then every position is scored with each KV dtype on the same tokens (a
   one-token request on the prefix, prefix caching on, so the prefix's K/V are read back from the cache
   as the dtype stores them). Reported: top-1 agreement with float32 KV, and the mean |delta logprob| of
   float32's token (when a dtype's top 20 miss it, the 20th logprob stands in: a lower bound).
3. Decode attention (the kernel alone) at ``--batch`` sequences x ``--context`` positions, the default
   model's heads (9 query, 3 KV, head_dim 64), blocks scattered: median time per call.

Section ``tier`` (``--kv-offloading-size``, the second KV tier), against the same engine without it:

4. An evicted conversation: a ``--conversation``-token prompt, then other prompts that reuse every pool
   block, then the prompt again: its time to first token (a one-token request) from the tier against a
   cold prefill, and whether the greedy continuations match.
5. A restart: a ``--restart-prefix``-token prompt served by an engine with ``--kv-offload-dir``, the
   engine closed, a new one on the same directory: time to first token against a cold prefill.

Section ``swap``: ``--swap-requests`` requests whose blocks need 4x the pool, run with preemption by
swapping and by recompute: every request completes with the greedy tokens of a run with room; total time.

Usage: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/kv_tiers.py [--out DIR]
[--sections quant tier swap]``; ``--quick`` runs a small version of each.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import best_time, conditions, print_table, write_json  # noqa: E402
from rawpaged import LLM, SamplingParams  # noqa: E402
from rawpaged.dtypes import kv_row_bytes  # noqa: E402
from rawpaged.model_executor.model_runner import kv_block_bytes  # noqa: E402

KV_DTYPES = ("float32", "int8", "fp8_e4m3")
#: the default model's attention geometry
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
PROMPTS = (
    "The history of the printing press begins",
    "Write a short poem about the sea at night.",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Explain to a child why the sky is blue.",
    "The three most important inventions of the twentieth century are",
    "Once upon a time, in a village at the edge of a forest,",
    "A good recipe for bread needs",
    "The capital of Australia is",
    "In mathematics, a prime number is",
)


def memory_rows(pool_bytes: int, seq_len: int) -> list:
    rows = []
    for kv in KV_DTYPES:
        per_token = kv_block_bytes(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv) / BLOCK_SIZE
        blocks = pool_bytes // kv_block_bytes(NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv)
        rows.append(
            dict(
                kv_cache_dtype=kv,
                bytes_per_token=int(per_token),
                vs_float32=kv_row_bytes(kv, HEAD_DIM) / kv_row_bytes("float32", HEAD_DIM),
                seqs_in_pool=int(blocks // math.ceil(seq_len / BLOCK_SIZE)),
            )
        )
    base = rows[0]["seqs_in_pool"]
    for r in rows:
        r["seqs_vs_float32"] = r["seqs_in_pool"] / base
    return rows


def _engine(kv: str) -> LLM:
    return LLM(device="cpu", kv_cache_dtype=kv, enable_prefix_caching=True, num_kv_blocks=4096, max_model_len=2048)


def score_positions(llm: LLM, prompt_ids: list, continuation: list) -> list:
    """Per position i: the top-20 logprobs after ``prompt_ids + continuation[:i]`` (one-token requests)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    out = []
    for i in range(len(continuation)):
        res = llm.generate([{"prompt_token_ids": prompt_ids + continuation[:i]}], params)[0]
        out.append(res.outputs[0].logprobs[0])
    return out


def _logprob(entry) -> float:
    return entry.logprob if hasattr(entry, "logprob") else float(entry)


def accuracy_rows(num_prompts: int, num_tokens: int) -> tuple:
    ref_llm = _engine("float32")
    tok = ref_llm.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:num_prompts]]
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    continuations = [
        o.outputs[0].token_ids for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    ]
    scored = {}
    seconds = {}
    for kv in KV_DTYPES:
        llm = ref_llm if kv == "float32" else _engine(kv)
        t0 = time.perf_counter()
        scored[kv] = [score_positions(llm, p, c) for p, c in zip(prompts, continuations)]
        seconds[kv] = time.perf_counter() - t0
    rows = []
    for kv in KV_DTYPES:
        agree, deltas, missing = [], [], 0
        for ref_seq, seq in zip(scored["float32"], scored[kv]):
            for ref_pos, pos in zip(ref_seq, seq):
                ref_lp = {t: _logprob(e) for t, e in ref_pos.items()}
                lp = {t: _logprob(e) for t, e in pos.items()}
                ref_top = max(ref_lp, key=ref_lp.get)
                agree.append(max(lp, key=lp.get) == ref_top)
                if ref_top not in lp:
                    missing += 1
                deltas.append(abs(lp.get(ref_top, min(lp.values())) - ref_lp[ref_top]))
        rows.append(
            dict(
                kv_cache_dtype=kv,
                positions=len(agree),
                top1_agreement=float(np.mean(agree)),
                mean_abs_dlogprob=float(np.mean(deltas)),
                max_abs_dlogprob=float(np.max(deltas)),
                ref_token_outside_top20=missing,
                scoring_s=seconds[kv],
            )
        )
    return rows, [tok.decode(c) for c in continuations]


def attention_rows(batch: int, context: int) -> list:
    from rawpaged.kernels.cpu import attention
    from rawpaged.kernels.cpu.backend import CPUBackend

    rng = np.random.default_rng(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_tables = rng.permutation(num_blocks)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq).astype(np.int32)
    context_lens = np.full(batch, context, np.int32)
    q = rng.standard_normal((batch, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    k = rng.standard_normal((num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    slots = np.arange(num_blocks * BLOCK_SIZE, dtype=np.int64)
    rows = []
    for kv in KV_DTYPES:
        kc, vc = (CPUBackend.allocate_kv_cache(shape, kv) for _ in range(2))
        CPUBackend.reshape_and_cache(k, v, kc, vc, slots)
        nbytes = sum(c.nbytes for c in (kc, vc)) * (batch * blocks_per_seq) / num_blocks

        def call(kc=kc, vc=vc):
            attention.paged_attention(out, q, kc, vc, block_tables, context_lens, HEAD_DIM**-0.5, context)

        t = best_time(call)
        rows.append(dict(kv_cache_dtype=kv, ms=t * 1e3, kv_MB_read=nbytes / 1e6, GB_per_s=nbytes / t / 1e9))
    base = rows[0]["ms"]
    for r in rows:
        r["speedup_vs_float32"] = base / r["ms"]
    return rows


def _warm(llm: LLM) -> LLM:
    """Compile every kernel a timed request runs before timing it: a 3-token request, then a 40-token one
    twice (tiled prefill, then prefill after a cached prefix: the path of a prompt served from the tier;
    a first call of that kernel compiles for seconds). The warm-up's blocks are evicted by the timed ones."""
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
    for _ in range(2):
        llm.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(max_tokens=1))
    return llm


def _ttft(llm: LLM, prompt_ids: list) -> float:
    """Seconds of a one-token greedy request on ``prompt_ids`` (its prefill, or its loads and last block)."""
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t0


def _continuation(llm: LLM, prompt_ids: list, n: int = 16) -> list:
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    return list(out[0].outputs[0].token_ids)


def _random_ids(n: int, seed: int) -> list:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 49000, n)]


def tier_rows(conversation: int, restart_prefix: int) -> list:
    """The evicted conversation and the restart (module docstring, 4 and 5)."""
    rows = []
    pool = -(-conversation // BLOCK_SIZE) + 8
    kw = dict(device="cpu", enable_prefix_caching=True, num_kv_blocks=pool, max_model_len=8192)
    conv = _random_ids(conversation, 1)
    cold_s = _ttft(_warm(LLM(**kw)), conv)
    cold_ids = _continuation(LLM(**kw), conv)
    llm = _warm(LLM(kv_offloading_size=2.0, **kw))
    first = _continuation(llm, conv)
    for i in range(3):  # other prompts take every pool block: the conversation's are evicted (to the tier)
        llm.generate([{"prompt_token_ids": _random_ids(conversation // 2, 10 + i)}], SamplingParams(max_tokens=1))
    hits = llm.stats()["kv_offload"]["prefix_hits"]
    back_s = _ttft(llm, conv)
    loaded = llm.stats()["kv_offload"]["prefix_hits"] - hits
    again = _continuation(llm, conv)
    rows.append(
        dict(
            case=f"evicted {conversation}-token conversation",
            cold_ttft_s=cold_s,
            tier_ttft_s=back_s,
            speedup=cold_s / back_s,
            blocks_loaded=loaded,
            same_greedy=first == again == cold_ids,
        )
    )
    llm.close()
    with tempfile.TemporaryDirectory() as tier_dir:
        prefix = _random_ids(restart_prefix, 2)
        kw = dict(device="cpu", enable_prefix_caching=True, num_kv_blocks=-(-restart_prefix // BLOCK_SIZE) + 8)
        cold_s = _ttft(_warm(LLM(**kw)), prefix)
        first = LLM(kv_offloading_size=1.0, kv_offload_dir=tier_dir, **kw)
        before = _continuation(first, prefix)
        first.close()
        restarted = _warm(LLM(kv_offloading_size=1.0, kv_offload_dir=tier_dir, **kw))
        restored = restarted.stats()["kv_offload"]["restored"]
        back_s = _ttft(restarted, prefix)
        rows.append(
            dict(
                case=f"{restart_prefix}-token prefix after a restart",
                cold_ttft_s=cold_s,
                tier_ttft_s=back_s,
                speedup=cold_s / back_s,
                blocks_loaded=restored,
                same_greedy=_continuation(restarted, prefix) == before,
            )
        )
        restarted.close()
    return rows


def swap_rows(num_requests: int, prompt_len: int, output_len: int, rounds: int = 3) -> list:
    """Swap against recompute under a load that needs 4x the pool (module docstring): one engine per mode,
    ``rounds`` runs each in alternating order, the median time."""
    need = num_requests * -(-(prompt_len + output_len) // BLOCK_SIZE)
    prompts = [{"prompt_token_ids": _random_ids(prompt_len, 100 + i)} for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    kw = dict(device="cpu", enable_prefix_caching=False, max_num_seqs=num_requests)
    want = [list(o.outputs[0].token_ids) for o in LLM(num_kv_blocks=need + 8, **kw).generate(prompts, params)]
    modes = ("recompute", "swap")
    engines = {m: _warm(LLM(num_kv_blocks=need // 4, kv_offloading_size=4.0, preemption_mode=m, **kw)) for m in modes}
    runs = {m: [] for m in modes}
    for r in range(rounds):  # alternating which mode goes first, so a drift in the host's speed falls on both
        for mode in modes if r % 2 == 0 else modes[::-1]:
            llm = engines[mode]
            before = llm.stats()
            t0 = time.perf_counter()
            out = llm.generate(prompts, params)
            seconds = time.perf_counter() - t0
            st = llm.stats()
            runs[mode].append(
                dict(
                    seconds=seconds,
                    preemptions=st["num_preemptions"] - before["num_preemptions"],
                    swapped_out=st["num_swapped_out"] - before["num_swapped_out"],
                    complete=len(out) == num_requests and all(len(o.outputs[0].token_ids) == output_len for o in out),
                    same=[list(o.outputs[0].token_ids) for o in out] == want,
                )
            )
    rows = []
    for mode in modes:
        engines[mode].close()
        rs = runs[mode]
        rows.append(
            dict(
                preemption=mode,
                pool_blocks=need // 4,
                blocks_needed=need,
                seconds=statistics.median(r["seconds"] for r in rs),
                rounds=len(rs),
                preemptions=rs[-1]["preemptions"],
                swapped_out=rs[-1]["swapped_out"],
                all_complete=all(r["complete"] for r in rs),
                same_greedy=all(r["same"] for r in rs),
            )
        )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    ap.add_argument("--conversation", type=int, default=4096)
    ap.add_argument("--restart-prefix", type=int, default=2048)
    ap.add_argument("--swap-requests", type=int, default=8)
    ap.add_argument("--swap-prompt", type=int, default=128)
    ap.add_argument("--swap-output", type=int, default=128)
    ap.add_argument("--sections", nargs="+", default=["quant", "tier", "swap"], choices=["quant", "tier", "swap"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens, args.batch, args.context = 2, 16, 4, 256
        args.conversation, args.restart_prefix, args.swap_requests, args.swap_prompt, args.swap_output = (
            256,
            128,
            4,
            32,
            32,
        )
    result = {}
    if "quant" in args.sections:
        result.update(quant_section(args))
    if "tier" in args.sections:
        tier = tier_rows(args.conversation, args.restart_prefix)
        print("\nSecond KV tier: time to first token from the tier against a cold prefill")
        print_table(tier, ["case", "cold_ttft_s", "tier_ttft_s", "speedup", "blocks_loaded", "same_greedy"])
        result["tier"] = tier
    if "swap" in args.sections:
        swap = swap_rows(args.swap_requests, args.swap_prompt, args.swap_output, 1 if args.quick else 3)
        print(f"\nPreemption under a load of 4x the pool ({args.swap_requests} requests)")
        print_table(
            swap,
            [
                "preemption",
                "pool_blocks",
                "blocks_needed",
                "seconds",
                "rounds",
                "preemptions",
                "swapped_out",
                "all_complete",
                "same_greedy",
            ],
        )
        result["swap"] = swap
    conds = conditions(
        model="SmolLM2-135M-Instruct (float32 weights)",
        sections=args.sections,
        prompts=args.prompts,
        tokens=args.tokens,
        batch=args.batch,
        context=args.context,
        pool_gib=args.pool_gib,
        conversation=args.conversation,
        restart_prefix=args.restart_prefix,
        swap=[args.swap_requests, args.swap_prompt, args.swap_output],
    )
    write_json(Path(args.out) / "kv_tiers.json", dict(conditions=conds, **result))


def quant_section(args) -> dict:
    memory = memory_rows(int(args.pool_gib * 2**30), 2048)
    print(f"\nKV bytes per token and 2K-token sequences in {args.pool_gib} GiB (default model)")
    print_table(memory, ["kv_cache_dtype", "bytes_per_token", "vs_float32", "seqs_in_pool", "seqs_vs_float32"])
    attn = attention_rows(args.batch, args.context)
    print(f"\nDecode attention, {args.batch} sequences x {args.context} positions (kernel only)")
    print_table(attn, ["kv_cache_dtype", "ms", "kv_MB_read", "GB_per_s", "speedup_vs_float32"])
    accuracy, texts = accuracy_rows(args.prompts, args.tokens)
    print(f"\nTeacher-forced against float32 KV, {args.prompts} prompts x {args.tokens} tokens")
    print_table(
        accuracy,
        [
            "kv_cache_dtype",
            "positions",
            "top1_agreement",
            "mean_abs_dlogprob",
            "max_abs_dlogprob",
            "ref_token_outside_top20",
        ],
    )
    return dict(memory=memory, decode_attention=attn, teacher_forced=accuracy, continuations=texts)


if __name__ == "__main__":
    main()
