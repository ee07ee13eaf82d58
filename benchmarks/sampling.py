"""Engine step time with the CPU backend's compiled sampler against the NumPy reference sampler, for
greedy, temperature-only and top-p sampling at a few batch sizes (the default model, decode steps).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import conditions, print_table, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[4, 64])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--out", default="benchmarks/out/sampling.json")
    args = p.parse_args(argv)

    from rawpaged.config import EngineConfig
    from rawpaged.engine.llm_engine import LLMEngine
    from rawpaged.kernels.cpu import sampling as cpu_sampling
    from rawpaged.sampling_params import SamplingParams
    from rawpaged.testing import reference_sampler

    engine = LLMEngine(EngineConfig(device="cpu", max_num_seqs=max(args.batches)))
    engine.warmup()
    prompts = [[(13 * i + 7 * j) % 40_000 + 10 for j in range(args.input_len)] for i in range(max(args.batches))]
    settings = {
        "T 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9, seed=1),
        "T 1.0": dict(temperature=1.0, seed=1),
        "greedy": dict(temperature=0.0),
    }

    def median_step_ms(batch, sampler, kw) -> float:
        engine.backend.sample = sampler
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **kw)
        for i in range(batch):
            engine.add_request({"prompt_token_ids": prompts[i]}, params)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3  # decode steps

    rows = []
    for batch in args.batches:
        for name, kw in settings.items():
            runs = [
                median_step_ms(batch, fn, kw) for fn in (reference_sampler.sample, cpu_sampling.sample) * 2
            ]  # alternating
            rows.append({"batch": batch, "sampling": name, "numpy_ms": min(runs[0::2]), "compiled_ms": min(runs[1::2])})
    print_table(rows, ["batch", "sampling", "numpy_ms", "compiled_ms"])
    write_json(args.out, {"conditions": conditions(model="default", input_len=args.input_len), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
