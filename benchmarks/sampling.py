"""Sampling's costs on the default model, CPU backend, in three tables:

1. ``samplers``: engine decode-step time with the compiled sampler against the NumPy reference sampler,
   for greedy, temperature-only and top-p sampling at a few batch sizes.
2. ``params``: a batch of decodes with no logits parameters against the same batch where every request
   sets all of them (repetition, frequency and presence penalties, 10 logit biases, min_tokens, two bad
   words; and allowed_token_ids alone): median step time, alternated runs, and the time the edits
   themselves took per step (the sparse edits' host build and kernel, measured around them).
3. ``prompt-logprobs``: a long prompt's prefill (max_tokens 1) with and without ``prompt_logprobs``:
   time, and the peak of Python-tracked allocations (NumPy's included) above the plain prefill's.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/sampling.py [--sections ...]
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

PARAMS_ALL = dict(
    repetition_penalty=1.1,
    frequency_penalty=0.5,
    presence_penalty=0.5,
    logit_bias={t: 0.5 for t in range(1000, 1010)},
    min_tokens=8,
    bad_words=["the", "and"],
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", default=["samplers", "params", "prompt-logprobs"])
    p.add_argument("--batches", type=int, nargs="+", default=[4, 64])
    p.add_argument("--params-batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--params-output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/out/sampling.json")
    args = p.parse_args(argv)

    from rawpaged.config import EngineConfig
    from rawpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            max_num_seqs=max(args.batches + [args.params_batch]),
            max_num_batched_tokens=max(2048, args.prompt_len),
            max_model_len=max(2048, args.prompt_len + 16),
            enable_prefix_caching=False,  # a repeated prompt must run its prefill each time
        )
    )
    engine.warmup()
    out = {"conditions": conditions(model="default", input_len=args.input_len)}
    if "samplers" in args.sections:
        out["samplers"] = samplers(engine, args)
    if "params" in args.sections:
        out["params"] = logits_params(engine, args)
    if "prompt-logprobs" in args.sections:
        out["prompt_logprobs"] = prompt_logprobs(engine, args)
    write_json(args.out, out)
    return 0


def _prompts(n: int, length: int) -> list:
    return [[(13 * i + 7 * j) % 40_000 + 10 for j in range(length)] for i in range(n)]


def _decode_steps_ms(engine, prompts, params) -> list:
    """Step times (ms) of one batch run to the end, prefill steps dropped."""
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[2:]


def samplers(engine, args) -> list:
    from rawpaged.kernels.cpu import sampling as cpu_sampling
    from rawpaged.sampling_params import SamplingParams
    from rawpaged.testing import reference_sampler

    prompts = _prompts(max(args.batches), args.input_len)
    settings = {
        "T 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9, seed=1),
        "T 1.0": dict(temperature=1.0, seed=1),
        "greedy": dict(temperature=0.0),
    }
    rows = []
    for batch in args.batches:
        for name, kw in settings.items():
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **kw)
            runs = []
            for fn in (reference_sampler.sample, cpu_sampling.sample) * 2:  # alternating
                engine.backend.sample = fn
                runs.append(statistics.median(_decode_steps_ms(engine, prompts[:batch], params)))
            rows.append({"batch": batch, "sampling": name, "numpy_ms": min(runs[0::2]), "compiled_ms": min(runs[1::2])})
    engine.backend.sample = cpu_sampling.sample
    print_table(rows, ["batch", "sampling", "numpy_ms", "compiled_ms"])
    return rows


def logits_params(engine, args) -> list:
    """Decode steps of a batch with and without the logits parameters (alternated, ``repeats`` each), and
    the edits' own time per step."""
    from rawpaged.sampling_params import SamplingParams

    selector = engine.token_selector
    apply_rules = selector._apply_logits_rules
    spent = []

    def timed(*a, **kw):
        t0 = time.perf_counter()
        apply_rules(*a, **kw)
        spent.append((time.perf_counter() - t0) * 1e3)

    selector._apply_logits_rules = timed
    prompts = _prompts(args.params_batch, args.input_len)
    base = dict(temperature=0.7, top_p=0.9, seed=1, max_tokens=args.params_output_len, ignore_eos=True)
    settings = {
        "none": SamplingParams(**base),
        "all but allowed_token_ids": SamplingParams(**base, **PARAMS_ALL),
        "allowed_token_ids (1000 ids)": SamplingParams(**base, allowed_token_ids=list(range(2000, 3000))),
    }
    steps = {name: [] for name in settings}
    edits = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, params in settings.items():
            spent.clear()
            steps[name] += _decode_steps_ms(engine, prompts, params)
            edits[name] += spent[2:]
    selector._apply_logits_rules = apply_rules
    plain = statistics.median(steps["none"])
    rows = []
    for name in settings:
        step = statistics.median(steps[name])
        edit = statistics.median(edits[name]) if edits[name] else 0.0
        rows.append(
            {
                "batch": args.params_batch,
                "parameters": name,
                "step_ms": round(step, 2),
                "vs_none": round(step / plain, 3),
                "edits_ms": round(edit, 3),
                "edits_share": round(edit / step, 4),
            }
        )
    print_table(rows, ["batch", "parameters", "step_ms", "vs_none", "edits_ms", "edits_share"])
    return rows


def prompt_logprobs(engine, args) -> list:
    """One ``prompt_len``-token prefill (max_tokens 1) with prompt_logprobs 0 and 5 against none:
    time (best of ``repeats``, alternated) and the peak tracked allocations above the plain run's."""
    import tracemalloc

    from rawpaged.sampling_params import SamplingParams

    ids = _prompts(1, args.prompt_len)[0]

    def run(k):
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k))
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        return seconds, peak

    times = {None: [], 0: [], 5: []}
    peaks = {None: [], 0: [], 5: []}
    for _ in range(args.repeats):
        for k in times:
            s, peak = run(k)
            times[k].append(s)
            peaks[k].append(peak)
    rows = []
    for k in times:
        rows.append(
            {
                "prompt_len": args.prompt_len,
                "prompt_logprobs": "none" if k is None else k,
                "seconds": round(min(times[k]), 3),
                "vs_prefill": round(min(times[k]) / min(times[None]), 3),
                "peak_mb": round(max(peaks[k]) / 2**20, 1),
                "extra_peak_mb": round((max(peaks[k]) - max(peaks[None])) / 2**20, 1),
            }
        )
    print_table(rows, ["prompt_len", "prompt_logprobs", "seconds", "vs_prefill", "peak_mb", "extra_peak_mb"])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
