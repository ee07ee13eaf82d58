"""Gemma 3 on the CPU against llama.cpp on the same GGUF and the same threads, side by side in one run (the
speed goals of issue 55):

- batch-1 decode and 512-token prefill against ``llama-bench``'s ``tg128``/``pp512`` (``kquants``' rounds:
  llama-bench, then ours, alternated; medians), plus our decode op by op (``--no-fused-decode``) beside it;
- per-stream speed (1 / TPOT p50) at concurrency 8 against ``llama-server`` (``serve.compare_servers``:
  both servers up, ABBA rounds);
- long context: our decode at a 4,096-token context against a 256-token one (the sliding layers read 512
  positions at most, so only the 3 full layers of 18 grow).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/gemma3_speed.py \\
        --llama-cpp-bin /path/to/llama.cpp/build/bin [--gguf FILE] [--rounds 3] [--out benchmarks/out/gemma3_speed.json]

Long-context decode: the prompt's first run fills the prefix cache; then the time of 1 token and of 1 +
64 tokens on the same (cached) prompt, and decode is the 64 tokens over their difference (the prefill,
cached or not, cancels).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import kquants, serve  # noqa: E402
from benchmarks.common import conditions, print_table, write_json  # noqa: E402

THREADS = kquants.THREADS
#: the goals of issue 55, as (metric, least ratio); a ratio > 1 means rawpaged is faster
GOALS = {"decode_tok_s": 1.0, "prefill_tok_s": 1.0, "c8_per_stream_tok_s": 1.2, "decode_256_over_4k": 1.2}
LONG_CONTEXTS = (256, 4096)
LONG_DECODE_TOKENS = 64
SERVE_CONCURRENCY = 8


def default_gguf() -> Path:
    """The prepared Gemma 3 270M Q4_K_M file (``rawpaged.weights.gemma3``; prepared first if needed)."""
    from rawpaged import weights as rp_weights

    return rp_weights.gemma3_gguf_path()


def short_context(gguf: Path, rounds: int, llama_bench: str) -> dict:
    """Batch-1 decode and 512-token prefill, ours (fused decode and op by op) and llama-bench's."""
    ours = kquants.Ours(str(gguf))
    op_by_op = kquants.Ours(str(gguf), fused_decode=False)
    runs = {"llama_cpp": [], "rawpaged": [], "rawpaged_op_by_op": []}
    for _ in range(rounds):
        runs["llama_cpp"].append(kquants.llama_bench(llama_bench, gguf))
        runs["rawpaged"].append(ours.measure())
        runs["rawpaged_op_by_op"].append(op_by_op.measure())
    del ours, op_by_op
    keys = ("decode_tok_s", "prefill_tok_s")
    return {
        "medians": {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()},
        "rounds": runs,
        "llama_cpp_build": runs["llama_cpp"][0]["build"],
    }


def long_context(gguf: Path, rounds: int) -> dict:
    """Our batch-1 decode tok/s at each of ``LONG_CONTEXTS`` (median of ``rounds``)."""
    import numpy as np

    from rawpaged import LLM, SamplingParams

    longest = max(LONG_CONTEXTS) + LONG_DECODE_TOKENS + 16
    llm = LLM(model=str(gguf), device="cpu", max_model_len=longest, num_kv_blocks=2048)

    def run(prompt, n) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params)
        return time.perf_counter() - t

    rng = np.random.default_rng(55)
    speeds = {n: [] for n in LONG_CONTEXTS}
    for _ in range(rounds):
        for n in LONG_CONTEXTS:
            prompt = rng.integers(100, 40000, n).tolist()  # fresh each round: the cache holds only this run's
            run(prompt, 1)
            first = run(prompt, 1)
            whole = run(prompt, 1 + LONG_DECODE_TOKENS)
            speeds[n].append(LONG_DECODE_TOKENS / (whole - first))
    return {f"decode_tok_s_at_{n}": statistics.median(v) for n, v in speeds.items()} | {"rounds": speeds}


def serving(gguf: Path, llama_server: str, rounds: int) -> dict:
    """``serve.compare_servers`` at concurrency 8: 16 requests of 64 prompt and 64 output tokens a round."""
    args = serve.main_parser().parse_args(
        [
            "--compare-llama-server",
            llama_server,
            "--compare-gguf",
            str(gguf),
            "--compare-rounds",
            str(rounds),
            "--concurrency",
            str(SERVE_CONCURRENCY),
            "--num-prompts",
            str(2 * SERVE_CONCURRENCY),
            "--input-len",
            "64",
            "--output-len",
            "64",
            "--server-args=--max-model-len 2048",
        ]
    )
    return serve.compare_servers(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--llama-cpp-bin", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, llama-server)"
    )
    p.add_argument("--gguf", type=Path, default=None, help="the Gemma 3 GGUF (default: the prepared 270M Q4_K_M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gemma3_speed.json")
    args = p.parse_args(argv)
    gguf = args.gguf or default_gguf()
    if not gguf.is_file():
        p.error(f"{gguf} does not exist")
    binaries = {name: args.llama_cpp_bin / name for name in ("llama-bench", "llama-server")}
    for path in binaries.values():
        if not path.is_file():
            p.error(f"{path} does not exist (build llama.cpp: docs/benchmarks.md)")

    short = short_context(gguf, args.rounds, str(binaries["llama-bench"]))
    long = long_context(gguf, args.rounds)
    served = serving(gguf, str(binaries["llama-server"]), max(2, args.rounds - 1))
    c8 = next(r for r in served["comparison"] if r["concurrency"] == SERVE_CONCURRENCY)

    ours, theirs = short["medians"]["rawpaged"], short["medians"]["llama_cpp"]
    op_by_op = short["medians"]["rawpaged_op_by_op"]
    per_stream = {k: 1000.0 / v for k, v in c8["tpot_p50_ms"].items() if k != "ratio"}
    at = {n: long[f"decode_tok_s_at_{n}"] for n in LONG_CONTEXTS}
    rows = [
        {"metric": "decode_tok_s", "rawpaged": ours["decode_tok_s"], "llama.cpp": theirs["decode_tok_s"]},
        {"metric": "prefill_tok_s", "rawpaged": ours["prefill_tok_s"], "llama.cpp": theirs["prefill_tok_s"]},
        {
            "metric": "c8_per_stream_tok_s",
            "rawpaged": per_stream["rawpaged"],
            "llama.cpp": per_stream["llama_server"],
        },
    ]
    for r in rows:
        r["ratio"] = r["rawpaged"] / r["llama.cpp"]
    rows.append(
        {"metric": "decode_256_over_4k", "rawpaged": at[256], "llama.cpp": at[4096], "ratio": at[256] / at[4096]}
    )
    rows.append(
        {
            "metric": "decode_tok_s_op_by_op",
            "rawpaged": op_by_op["decode_tok_s"],
            "llama.cpp": theirs["decode_tok_s"],
            "ratio": op_by_op["decode_tok_s"] / theirs["decode_tok_s"],
        }
    )
    for r in rows:
        goal = GOALS.get(r["metric"])
        if goal is not None:
            r["goal"] = f"<= {goal}x" if r["metric"] == "decode_256_over_4k" else f">= {goal}x"
            r["met"] = r["ratio"] <= goal if r["metric"] == "decode_256_over_4k" else r["ratio"] >= goal
    print_table(rows, ["metric", "rawpaged", "llama.cpp", "ratio", "goal", "met"])
    print("decode_256_over_4k: our decode tok/s at 256 context (rawpaged column) and at 4K (llama.cpp column)")
    cond = conditions(
        threads=THREADS,
        file=str(gguf),
        file_bytes=gguf.stat().st_size,
        llama_cpp=f"{args.llama_cpp_bin} (llama-bench tg{kquants.DECODE_TOKENS}/pp{kquants.PREFILL_TOKENS}, "
        f"llama-server -np {SERVE_CONCURRENCY})",
        llama_cpp_build=short["llama_cpp_build"],
        rounds=args.rounds,
        load_average=os.getloadavg(),
    )
    cond["openblas_env_unset"] = "OPENBLAS_CORETYPE" not in os.environ and "OPENBLAS_L2_SIZE" not in os.environ
    write_json(args.out, {"conditions": cond, "table": rows, "short": short, "long": long, "serving": served})
    return 0


if __name__ == "__main__":
    sys.exit(main())
