"""CPU decode step time with the decoder layers in one compiled call (``cpu_fused_decode``) against the
same engine run op by op, at a few batch sizes (the default model, float32 or its Q4_1 file).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/decode_step.py [--weights q4_1]

One engine; each round runs every batch size once fused and once op by op, alternating which goes first,
so a change in the host's speed falls on both. A row reports the medians over the rounds of each step's
median decode step (prompt steps excluded), the speed-up, the weight bytes a fused step streams per
second and their share of the host's read bandwidth (``common.read_bandwidth``), and whether both paths
gave the same tokens. Run it on an otherwise idle host: with other work on the cores the medians are noise.
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

from benchmarks.common import conditions, print_table, read_bandwidth, write_json  # noqa: E402


def weight_bytes(model) -> int:
    """Bytes of the decoder layers' linear weights and the LM head: what a decode step reads."""
    total = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            total += layer[name].nbytes
    return total + model.lm_head.nbytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--weights", choices=["f32", "q4_1"], default="f32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="benchmarks/out/decode_step.json")
    args = p.parse_args(argv)

    from rawpaged import weights as rp_weights
    from rawpaged.config import EngineConfig
    from rawpaged.engine.llm_engine import LLMEngine
    from rawpaged.sampling_params import SamplingParams

    model = rp_weights.default_gguf_path() if args.weights == "q4_1" else rp_weights.prepare(progress=True)
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", max_num_seqs=max(args.batches)))
    engine.warmup()
    runner = engine.runner
    fused = runner.fused_decode
    prompts = [[(13 * i + 7 * j) % 40_000 + 10 for j in range(args.input_len)] for i in range(max(args.batches))]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def median_step_ms(batch: int, use_fused: bool):
        runner.fused_decode = fused if use_fused else None
        ids = [engine.add_request({"prompt_token_ids": prompts[i]}, params) for i in range(batch)]
        times, tokens = [], {}
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            for o in outs:
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
        runner.fused_decode = fused
        return statistics.median(times[1:]) * 1e3, [tokens[i] for i in ids]

    runs = {(b, f): [] for b in args.batches for f in (True, False)}
    same = dict.fromkeys(args.batches, True)
    for r in range(args.rounds):
        for batch in args.batches:
            toks = {}
            for use_fused in (True, False) if r % 2 == 0 else (False, True):
                ms, toks[use_fused] = median_step_ms(batch, use_fused)
                runs[batch, use_fused].append(ms)
            same[batch] &= toks[True] == toks[False]
    bandwidth = read_bandwidth()
    nbytes = weight_bytes(engine.model)
    rows = []
    for batch in args.batches:
        fused_ms = statistics.median(runs[batch, True])
        op_ms = statistics.median(runs[batch, False])
        rows.append(
            {
                "batch": batch,
                "op_by_op_ms": op_ms,
                "fused_ms": fused_ms,
                "speedup": op_ms / fused_ms,
                "fused_GB_s": nbytes / fused_ms / 1e6,
                "of_read_bandwidth": f"{nbytes / fused_ms * 1e3 / bandwidth:.0%}",
                "same_tokens": same[batch],
            }
        )
    print(f"weights per step: {nbytes / 1e6:.0f} MB; read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    print_table(rows, ["batch", "op_by_op_ms", "fused_ms", "speedup", "fused_GB_s", "of_read_bandwidth", "same_tokens"])
    write_json(
        args.out,
        {
            "conditions": conditions(
                model=str(model),
                weights=args.weights,
                weight_bytes_per_step=nbytes,
                read_bandwidth_GB_s=bandwidth / 1e9,
                input_len=args.input_len,
                output_len=args.output_len,
                rounds=args.rounds,
            ),
            "rows": rows,
            "runs": {f"{b}/{'fused' if f else 'op_by_op'}": v for (b, f), v in runs.items()},
        },
    )
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
