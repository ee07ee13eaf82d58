"""GGUF files side by side with llama.cpp's ``llama-bench``: batch-1 decode and 512-token prefill on the same
file and the same threads, alternated in one run, plus our resident memory after loading.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/kquants.py \\
        --llama-bench /path/to/llama-bench [--gguf FILE ...] [--rounds 3] [--out benchmarks/out/kquants.json]

Default files: the default model's Q4_K_M (``scripts/q4_k_m_check.py`` makes it) and its F32 GGUF (our
side runs the prepared float32 safetensors, the same weights). Our decode is the time of 1 + 128 greedy
tokens after a 20-token prompt minus the time of the prefill and first token alone (``llama-bench``'s
``tg128`` times 128 tokens after an empty context); prefill is one 512-token prompt's time to its first
token (``pp512``). Each round runs llama-bench, then ours; each engine's row is the median of its rounds.
RSS: the process's resident set after loading the model and allocating the KV pool, less before; the pool
size is given beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import conditions, fresh_process_memory, print_table, write_json  # noqa: E402

THREADS = 2
DECODE_TOKENS = 128
PROMPT_TOKENS = 20
PREFILL_TOKENS = 512
#: the engine options of every run (a pool of 256 blocks, max_model_len 2048)
ENGINE_ARGS = {"num_kv_blocks": 256, "max_model_len": 2048}


def llama_bench(binary: str, gguf: Path) -> dict:
    """llama.cpp's tok/s for tg128 and pp512 (one run of each, ``-r 1``)."""
    cmd = [binary, "-m", str(gguf), "-t", str(THREADS), "-p", str(PREFILL_TOKENS), "-n", str(DECODE_TOKENS)]
    out = subprocess.run(cmd + ["-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    tg = next(r for r in rows if r["n_gen"] == DECODE_TOKENS)
    pp = next(r for r in rows if r["n_prompt"] == PREFILL_TOKENS)
    return {"decode_tok_s": tg["avg_ts"], "prefill_tok_s": pp["avg_ts"], "build": rows[0].get("build_commit")}


class Ours:
    """Our engine on ``model`` (CPU; ``engine_args`` override the LLM's pool of 256 blocks and
    max_model_len 2048), compiled on both paths, with :meth:`measure` timing decode and prefill."""

    def __init__(self, model: str, **engine_args):
        from rawpaged import LLM

        self.llm = LLM(model=model, device="cpu", **{**ENGINE_ARGS, **engine_args})
        runner = self.llm.engine.runner
        caches = list(runner.key_caches) + list(runner.value_caches)
        self.kv_pool_bytes = sum(int(getattr(c, "nbytes", 0)) for c in caches)
        self.rng_seed = 0
        self._run(list(range(100, 100 + PREFILL_TOKENS)), 2)  # compile every path once
        self._run(list(range(200, 200 + PROMPT_TOKENS)), 4)

    def _run(self, prompt, n) -> float:
        from rawpaged import SamplingParams

        t = time.perf_counter()
        self.llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    def measure(self) -> dict:
        import numpy as np

        self.rng_seed += 1
        rng = np.random.default_rng(self.rng_seed)  # fresh prompts: no prefix-cache hits
        prompt = rng.integers(100, 40000, PROMPT_TOKENS).tolist()
        first = self._run(prompt, 1)
        prompt = rng.integers(100, 40000, PROMPT_TOKENS).tolist()
        whole = self._run(prompt, 1 + DECODE_TOKENS)
        long = rng.integers(100, 40000, PREFILL_TOKENS).tolist()
        prefill = self._run(long, 1)
        return {"decode_tok_s": DECODE_TOKENS / (whole - first), "prefill_tok_s": PREFILL_TOKENS / prefill}


def main(argv=None) -> int:
    from rawpaged import weights as rp_weights

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bench", required=True, help="a llama-bench binary built for this host")
    p.add_argument("--gguf", type=Path, nargs="*", help="GGUF files (default: the Q4_K_M and F32 of the default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "kquants.json")
    args = p.parse_args(argv)
    files = args.gguf or [
        rp_weights.default_model_dir() / "SmolLM2-135M-Instruct.Q4_K_M.gguf",
        rp_weights.default_f32_gguf_path(),
    ]
    rows, results = [], []
    for gguf in files:
        if not gguf.is_file():
            p.error(f"{gguf} does not exist (scripts/q4_k_m_check.py makes the Q4_K_M file)")
        ours_model = str(rp_weights.prepare(progress=True)) if gguf.name.endswith(".F32.gguf") else str(gguf)
        ours = Ours(ours_model)
        theirs, mine = [], []
        for _ in range(args.rounds):
            theirs.append(llama_bench(args.llama_bench, gguf))
            mine.append(ours.measure())

        def med(runs, key):
            return statistics.median(r[key] for r in runs)

        result = {
            "file": gguf.name,
            "file_bytes": gguf.stat().st_size,
            "ours_model": ours_model,
            "llama_cpp": {k: med(theirs, k) for k in ("decode_tok_s", "prefill_tok_s")},
            "rawpaged": {k: med(mine, k) for k in ("decode_tok_s", "prefill_tok_s")},
            "rounds": {"llama_cpp": theirs, "rawpaged": mine},
            "memory": fresh_process_memory(ours_model, ENGINE_ARGS, env=os.environ.copy()),
            "kv_pool_bytes": ours.kv_pool_bytes,
            "llama_cpp_build": theirs[0]["build"],
        }
        results.append(result)
        for what in ("decode_tok_s", "prefill_tok_s"):
            a, b = result["rawpaged"][what], result["llama_cpp"][what]
            rows.append({"file": gguf.name, "metric": what, "rawpaged": a, "llama.cpp": b, "ratio": a / b})
        del ours
    print_table(rows, ["file", "metric", "rawpaged", "llama.cpp", "ratio"])
    for r in results:
        print(
            f"{r['file']}: RSS after load {r['memory']['rss_after_load_bytes'] / 1e6:.0f} MB in a fresh process "
            f"(file {r['file_bytes'] / 1e6:.0f} MB, KV pool {r['kv_pool_bytes'] / 1e6:.0f} MB)"
        )
    cond = conditions(threads=THREADS, llama_cpp="llama-bench, GGML_NATIVE=ON", rounds=args.rounds)
    cond["openblas_env_unset"] = "OPENBLAS_CORETYPE" not in os.environ and "OPENBLAS_L2_SIZE" not in os.environ
    write_json(args.out, {"conditions": cond, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
