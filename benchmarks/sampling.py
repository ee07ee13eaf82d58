"""Sampling's costs on the default model, CPU backend, in three tables:

1. ``samplers``: engine decode-step time and the sampler's own time per step, the compiled sampler
   against the NumPy reference sampler (and, with ``--baseline-sampler REV``, the compiled sampler of an
   earlier git revision, side by side), for greedy, temperature-only and top-p sampling at a few batch
   sizes.
2. ``params``: a batch of decodes with no logits parameters against the same batch where every request
   sets all of them (repetition, frequency and presence penalties, 10 logit biases, min_tokens, two bad
   words; and allowed_token_ids alone), greedy and with top-p: median step time, alternated runs, the
   time the edits themselves took per step (the sparse edits' host build and kernel, measured around
   them) and the sampler's (a flatter distribution makes top-p's candidate set larger).
3. ``prompt-logprobs``: a long prompt's prefill (max_tokens 1) with and without ``prompt_logprobs``:
   time, and the peak RSS of a fresh process running it once above the plain prefill's.

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
    p.add_argument("--baseline-sampler", metavar="REV", help="also time the CPU sampler as of this git revision")
    p.add_argument("--out", default="benchmarks/out/sampling.json")
    p.add_argument("--child-peak", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_peak is not None:
        return child_peak(args.child_peak, args.prompt_len)

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
    """Decode steps with the NumPy reference sampler and the compiled one (and, with ``--baseline-sampler
    REV``, the compiled sampler as of git revision REV), alternated: median step ms and the sampler's own ms
    per step."""
    from rawpaged.kernels.cpu import sampling as cpu_sampling
    from rawpaged.sampling_params import SamplingParams
    from rawpaged.testing import reference_sampler

    candidates = {"numpy": reference_sampler.sample, "compiled": cpu_sampling.sample}
    if args.baseline_sampler:
        candidates[f"compiled@{args.baseline_sampler}"] = _sampler_at(args.baseline_sampler)
    prompts = _prompts(max(args.batches), args.input_len)
    settings = {
        "T 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9, seed=1),
        "T 1.0": dict(temperature=1.0, seed=1),
        "greedy": dict(temperature=0.0),
    }
    spent = []

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            spent.append((time.perf_counter() - t0) * 1e3)
            return result

        return wrapper

    rows = []
    for batch in args.batches:
        for name, kw in settings.items():
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **kw)
            steps = {c: [] for c in candidates}
            own = {c: [] for c in candidates}
            for _ in range(2):  # alternated, the better run of each kept
                for c, fn in candidates.items():
                    engine.backend.sample = timed(fn)
                    spent.clear()
                    steps[c].append(statistics.median(_decode_steps_ms(engine, prompts[:batch], params)))
                    own[c].append(statistics.median(spent[2:]))
            row = {"batch": batch, "sampling": name}
            for c in candidates:
                row[f"{c} step ms"] = round(min(steps[c]), 1)
                row[f"{c} sampler ms"] = round(min(own[c]), 2)
            rows.append(row)
    engine.backend.sample = cpu_sampling.sample
    print_table(rows, list(rows[0]))
    return rows


def _sampler_at(rev: str):
    """``sample`` of ``rawpaged/kernels/cpu/sampling.py`` as of git revision ``rev`` (written to a fresh
    temporary folder and imported from there, so no stale Numba cache is read), for a side-by-side run."""
    import importlib.util
    import subprocess
    import tempfile

    source = subprocess.run(
        ["git", "show", f"{rev}:rawpaged/kernels/cpu/sampling.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="sampler-")) / f"sampling_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sampling_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sample


def logits_params(engine, args) -> list:
    """Decode steps of a batch with and without the logits parameters (alternated, ``repeats`` each), and
    the edits' own time per step."""
    from rawpaged.sampling_params import SamplingParams

    selector, runner = engine.token_selector, engine.runner
    apply_rules, sample = selector._apply_logits_rules, runner.sample
    spent = {"edits": [], "sampler": []}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            spent[key].append((time.perf_counter() - t0) * 1e3)
            return result

        return wrapper

    selector._apply_logits_rules = timed(apply_rules, "edits")
    runner.sample = timed(sample, "sampler")
    prompts = _prompts(args.params_batch, args.input_len)
    rows = []
    for sampling, kw in (("greedy", dict(temperature=0.0)), ("T 0.7, top_p 0.9", dict(temperature=0.7, top_p=0.9))):
        base = dict(seed=1, max_tokens=args.params_output_len, ignore_eos=True, **kw)
        settings = {
            "none": SamplingParams(**base),
            "all but allowed_token_ids": SamplingParams(**base, **PARAMS_ALL),
            "allowed_token_ids (1000 ids)": SamplingParams(**base, allowed_token_ids=list(range(2000, 3000))),
        }
        measured = {name: {"step": [], "edits": [], "sampler": []} for name in settings}
        for _ in range(args.repeats):  # alternated, so drift hits every setting alike
            for name, params in settings.items():
                for v in spent.values():
                    v.clear()
                measured[name]["step"] += _decode_steps_ms(engine, prompts, params)
                measured[name]["edits"] += spent["edits"][2:]
                measured[name]["sampler"] += spent["sampler"][2:]
        plain = statistics.median(measured["none"]["step"])
        for name in settings:
            m = {k: statistics.median(v) if v else 0.0 for k, v in measured[name].items()}
            rows.append(
                {
                    "batch": args.params_batch,
                    "sampling": sampling,
                    "parameters": name,
                    "step_ms": round(m["step"], 2),
                    "vs_none": round(m["step"] / plain, 3),
                    "edits_ms": round(m["edits"], 3),
                    "edits_share": round(m["edits"] / m["step"], 4),
                    "sampler_ms": round(m["sampler"], 2),
                }
            )
    selector._apply_logits_rules, runner.sample = apply_rules, sample
    print_table(
        rows, ["batch", "sampling", "parameters", "step_ms", "vs_none", "edits_ms", "edits_share", "sampler_ms"]
    )
    return rows


def _prefill(engine, ids, k) -> float:
    """Seconds to run one prompt to its first token with ``prompt_logprobs=k`` (None: off)."""
    from rawpaged.sampling_params import SamplingParams

    engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def _peak_rss_mb(prompt_len: int, k) -> float:
    """The peak RSS (MB) of a fresh process that loads the engine, warms up, and runs the prompt once."""
    import subprocess

    cmd = [sys.executable, __file__, "--child-peak", str(-1 if k is None else k), "--prompt-len", str(prompt_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def prompt_logprobs(engine, args) -> list:
    """One ``prompt_len``-token prefill (max_tokens 1) with prompt_logprobs 0 and 5 against none: time
    (best of ``repeats``, alternated), and each run's peak RSS in a fresh process against the plain one's
    (what prompt logprobs add at their peak: the LM head's chunks)."""
    ids = _prompts(1, args.prompt_len)[0]
    ks = (None, 0, 5)
    times = {k: [] for k in ks}
    for _ in range(args.repeats):
        for k in ks:
            times[k].append(_prefill(engine, ids, k))
    peaks = {k: _peak_rss_mb(args.prompt_len, k) for k in ks}
    rows = []
    for k in ks:
        rows.append(
            {
                "prompt_len": args.prompt_len,
                "prompt_logprobs": "none" if k is None else k,
                "seconds": round(min(times[k]), 3),
                "vs_prefill": round(min(times[k]) / min(times[None]), 3),
                "peak_rss_mb": round(peaks[k], 1),
                "extra_peak_mb": round(peaks[k] - peaks[None], 1),
            }
        )
    print_table(rows, ["prompt_len", "prompt_logprobs", "seconds", "vs_prefill", "peak_rss_mb", "extra_peak_mb"])
    return rows


def child_peak(k: int, prompt_len: int) -> int:
    """``_peak_rss_mb``'s child: prints its peak RSS in MB after one run (``k`` -1: no prompt logprobs)."""
    import resource

    from rawpaged.config import EngineConfig
    from rawpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            max_num_batched_tokens=max(2048, prompt_len),
            max_model_len=max(2048, prompt_len + 16),
            enable_prefix_caching=False,
        )
    )
    engine.warmup()
    _prefill(engine, _prompts(1, prompt_len)[0], None if k < 0 else k)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
