"""Device check: the CUDA engine against the CPU engine on randomly initialised models (no downloads).

For the default model's shapes and a larger Llama-like shape (head_dim 128), runs the same greedy
requests on ``device="cpu"`` and on ``device="cuda"`` in float32 and in bfloat16 (the CUDA default),
compares first-step logits (max abs difference) and generated ids, runs seeded top-p sampling on the
device, then times CUDA decode at batch 1, 8, 32 and 64 and a 512-token prefill. On the default model's
shape it does the same with decode replayed from CUDA graphs (``enforce_eager=False``) and prints the
graphs/eager decode ratios. ``FEATURE_SHAPES`` add the families' features (a
Mistral sliding window with YaRN, Qwen3 q/k norms with Llama 3 RoPE, Q8_0 weights quantized on load: the
blocks stay quantized on both backends), and ``MOE_CHECK_SHAPES`` random mixtures of experts (Qwen3-MoE,
Qwen2-MoE with its shared expert, Mixtral), checked the same way without timings.
Writes ``engine_<shape>.json`` to ``--out`` as each shape finishes, and ``engine_check.json`` (all of them)
at the end.

Usage: ``python -m rawpaged.tools.check_cuda_engine --out DIR [--shapes a,b] [--cpu-only]`` (exit code 1 if a
check fails). ``--cpu-only`` runs the CPU engine's half of each shape (the reference), with no GPU: CI
runs it as the GPU host would, without the packages that host lacks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rawpaged import LLM, SamplingParams
from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.core.sequence import Sequence
from rawpaged.testing.random_model import SHAPES as RANDOM_SHAPES
from rawpaged.testing.random_model import write_random_model

#: timed on a device: the default model's shape and a Llama-like head_dim 128
SHAPES = {name: RANDOM_SHAPES[name] for name in ("smollm2-135m-shape", "llama-like-head128")}
#: the families' features on a device, checked without timings (see ``rawpaged.testing.random_model.SHAPES``)
FEATURE_SHAPES = {
    name: RANDOM_SHAPES[name]
    for name in (
        "q8_0-on-load",
        "mistral-window256-yarn",
        "qwen3-head128-llama3",
        "gemma2-window128",
        "gemma3-head256-window128",
    )
}
#: mixtures of experts on a device (the router, alignment, grouped products and combine of cuda/moe.cu and
#: cuda/quant.cu), checked as the features are, without timings
MOE_CHECK_SHAPES = {name: RANDOM_SHAPES[name] for name in ("qwen3-moe-head64", "qwen2-moe-head64", "mixtral-head64")}


def _first_logits(llm, prompt_ids):
    """float32 logits of the token after ``prompt_ids`` (one prefill through the engine's runner)."""

    eng = llm.engine
    kv = eng.kv_cache_manager
    seq = Sequence(0, "check", 0, list(prompt_ids), SamplingParams(), None, 0.0)
    assert kv.allocate_slots(seq, len(prompt_ids))
    logits, *_ = eng.runner.execute_model(SchedulerOutput(scheduled=[(seq, len(prompt_ids))]))
    kv.free(seq)
    return eng.runner.fetch_rows(logits, [0])[0]


#: float32: a greedy divergence is a near-tie when the CPU's top two logits at that step are this close
#: (relative to the step's largest |logit|); float32 kernels that sum in other orders may pick either
NEAR_TIE_RELATIVE = 1e-4


def classify_divergences(cpu_llm, prompts, cpu_ids, gpu_ids, relative=NEAR_TIE_RELATIVE) -> dict:
    """Compare two backends' greedy outputs per prompt, allowing near-ties.

    At each prompt's first differing token, the CPU engine's logits for that step (prompt plus the
    shared prefix) decide: a gap between the CPU's top two logits of at most ``relative`` times the
    step's largest |logit| is a near-tie (either pick is right; later tokens then differ anyway), any
    larger gap a real divergence. Returns counts ``equal``, ``near_ties``, ``divergences`` and, per
    prompt, the first divergence with its top-2 gap (None where equal).
    """
    equal = near = real = 0
    details = []
    for prompt, a, b in zip(prompts, cpu_ids, gpu_ids):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None and len(a) == len(b):
            equal += 1
            details.append(None)
            continue
        i = min(len(a), len(b)) if i is None else i
        logits = np.asarray(_first_logits(cpu_llm, list(prompt) + list(a[:i])), dtype=np.float64)
        top2 = np.sort(logits)[-2:]
        gap = float(top2[1] - top2[0])
        tie = gap <= relative * float(np.max(np.abs(logits)))
        near += tie
        real += not tie
        details.append({"index": i, "top2_gap": gap, "near_tie": bool(tie)})
    return {"equal": equal, "near_ties": near, "divergences": real, "per_prompt": details}


def _timings(llm, rng, batches=(1, 32), max_tokens=64, prefill_len=512) -> dict:
    """Decode tok/s per batch size (``batch`` 32-token prompts: the time of ``max_tokens + 1`` tokens
    minus that of the prefill and first token alone, so prefill is not counted) and, with
    ``prefill_len``, one prompt of that many tokens' prefill time in ms."""

    def timed(prompts, n):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    timing = {}
    for batch in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, 259, 32).tolist()} for _ in range(batch)]
        timed(prompts[:1], 2)  # warm-up
        first = timed(prompts, 1)
        total = timed(prompts, max_tokens + 1)
        timing[f"batch{batch}_tok_per_s"] = batch * max_tokens / max(total - first, 1e-9)
    if prefill_len:
        prompt = [{"prompt_token_ids": rng.integers(3, 259, prefill_len).tolist()}]
        timed(prompt, 1)
        timing[f"prefill{prefill_len}_ms"] = 1e3 * min(timed(prompt, 1) for _ in range(3))
    return timing


PROMPT_LENS = (1, 15, 16, 17, 33, 100, 257, 600)


def cpu_reference(name, shape, tmp, rng, prompt_lens=PROMPT_LENS, max_tokens=24) -> dict:
    """The CPU engine's side of ``check_shape``: a random model of ``shape`` written under ``tmp``, the
    prompts drawn from ``rng``, the CPU's first-step logits and greedy ids. Returns a dict with the CPU
    ``llm``, ``prompts``, ``logits``, ``ids``, the greedy and sampled ``SamplingParams``, the engine
    options ``kw`` and the ``shape`` without its quantization."""

    shape = dict(shape)
    quantization = shape.pop("quantization", None)
    model = write_random_model(Path(tmp) / name, seed=0, **shape)
    prompts = [rng.integers(3, 259, int(n)).tolist() for n in prompt_lens]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(model), num_kv_blocks=1024, max_model_len=2048, enable_prefix_caching=False)
    kw["quantization"] = quantization
    cpu = LLM(device="cpu", **kw)
    logits = [_first_logits(cpu, p) for p in prompts]
    ids = [o.outputs[0].token_ids for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return dict(llm=cpu, prompts=prompts, logits=logits, ids=ids, params=params, sampled=sampled, kw=kw, shape=shape)


def check_shape(
    name,
    shape,
    tmp,
    rng,
    prompt_lens=PROMPT_LENS,
    max_tokens=24,
    timing_batches=(1, 32),
    timing_tokens=64,
    graphs=(),
    prefill_len=512,
):
    """float32 on CUDA must reproduce the CPU engine (logits within 1e-2, greedy ids equal up to near-ties,
    ``classify_divergences``); bfloat16 (the CUDA default) is held to its precision: first-step logits
    within 10% of their largest magnitude, with its first-step top-1 agreement and its divergences
    reported. Seeded top-p sampling must run and return valid ids on both.

    For each dtype in ``graphs`` it also runs with ``enforce_eager=False`` (decode replayed from CUDA
    graphs): float32 held to the same rule against the CPU, its ids compared with eager's on the device
    (equal, or divergent only where eager diverges from the CPU too), and the same timings."""

    ref = cpu_reference(name, shape, tmp, rng, prompt_lens, max_tokens)
    cpu, prompts, cpu_logits, cpu_ids, params, sampled, kw = (
        ref[k] for k in ("llm", "prompts", "logits", "ids", "params", "sampled", "kw")
    )
    shape = ref["shape"]
    result = {"shape": shape, "quantization": kw["quantization"], "num_prompts": len(prompts), "ok": True}
    for dtype in ("float32", "bfloat16"):
        gpu = LLM(device="cuda", dtype=dtype, **kw)
        scale = max(float(np.max(np.abs(c))) for c in cpu_logits)
        gpu_ids = [o.outputs[0].token_ids for o in gpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
        agreement = classify_divergences(cpu, prompts, cpu_ids, gpu_ids)
        equal = agreement["equal"]
        gpu_logits = [_first_logits(gpu, p) for p in prompts]
        diffs = [float(np.max(np.abs(c - g))) for c, g in zip(cpu_logits, gpu_logits)]
        top1 = sum(int(np.argmax(c)) == int(np.argmax(g)) for c, g in zip(cpu_logits, gpu_logits))
        draws = [o.outputs[0].token_ids for o in gpu.generate([{"prompt_token_ids": p} for p in prompts[:4]], sampled)]
        vocab = shape["vocab_size"]
        stats = gpu.stats()
        timings = _timings(gpu, rng, timing_batches, timing_tokens, prefill_len) if timing_batches else {}
        r = {
            "max_abs_logit_diff": max(diffs),
            "max_abs_logit": scale,
            "per_prompt_logit_diff": diffs,
            "ids_equal": equal,
            "near_ties": agreement["near_ties"],
            "divergences": agreement["divergences"],
            "divergence_details": agreement["per_prompt"],
            "first_step_top1_agreement": top1 / len(prompts),
            "sampled_ids_valid": all(len(d) == 16 and all(0 <= t < vocab for t in d) for d in draws),
            "blocks_all_free": stats["num_free_blocks"] == stats["num_total_blocks"],
            **timings,
        }
        if dtype == "float32":  # equal greedy ids up to near-ties
            close = max(diffs) < 1e-2 and agreement["divergences"] == 0
        else:  # bfloat16 is held to its precision; its agreement is reported
            close = max(diffs) < 0.1 * scale
        r["ok"] = bool(close and r["sampled_ids_valid"] and r["blocks_all_free"])
        del gpu
        if dtype in graphs:
            r["graphs"] = _check_graphs(
                kw, dtype, prompts, params, cpu, cpu_ids, gpu_ids, rng, timing_batches, timing_tokens
            )
            r["ok"] = r["ok"] and r["graphs"]["ok"]
        result[dtype] = r
        result["ok"] = result["ok"] and r["ok"]
    return result


def _check_graphs(kw, dtype, prompts, params, cpu, cpu_ids, eager_ids, rng, timing_batches, timing_tokens) -> dict:
    """The engine with CUDA graphs for decode (``enforce_eager=False``) against the CPU and eager."""

    t0 = time.perf_counter()
    llm = LLM(device="cuda", dtype=dtype, enforce_eager=False, **kw)
    startup = time.perf_counter() - t0
    runner = llm.engine.runner.cuda_graph
    ids = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    agreement = classify_divergences(cpu, prompts, cpu_ids, ids)
    stats = llm.stats()
    r = {
        "captured_sizes": sorted(runner.graphs),
        "startup_s": startup,
        "ids_equal_cpu": agreement["equal"],
        "near_ties": agreement["near_ties"],
        "divergences": agreement["divergences"],
        "ids_equal_eager": sum(a == b for a, b in zip(ids, eager_ids)),
        "replayed_steps": sum(runner.num_steps.values()),
        "blocks_all_free": stats["num_free_blocks"] == stats["num_total_blocks"],
    }
    r.update(_timings(llm, rng, timing_batches, timing_tokens, 0) if timing_batches else {})
    # every size captured on a device; the CPU emulation captures none and runs the same static path
    expected = runner.capture_sizes if llm.engine.backend.supports_cuda_graphs else []
    replayed = r["replayed_steps"] > 0 and r["captured_sizes"] == expected
    if dtype == "float32":
        r["ok"] = bool(replayed and r["blocks_all_free"] and agreement["divergences"] == 0)
    else:  # bf16 ids may part at near-ties of bf16 precision; the run and its blocks must be sound
        r["ok"] = bool(replayed and r["blocks_all_free"])
    del llm
    return r


def _rates(d: dict) -> str:
    return " ".join(f"{k.split('_')[0]}={v:.0f}" for k, v in d.items() if k.endswith("_tok_per_s"))


def _print_result(name, r) -> None:
    if "error" in r:
        print(f"{name}: ok=False {r['error']}", flush=True)
        return
    if r.get("cpu_only"):
        print(f"{name}: ok={r['ok']} (CPU side only) {r['num_prompts']} prompts, {r['seconds']:.1f} s", flush=True)
        return
    for dtype in ("float32", "bfloat16"):
        d = r[dtype]
        print(
            f"{name} {dtype}: ok={d['ok']} max|dlogit|={d['max_abs_logit_diff']:.2e} "
            f"(max|logit| {d['max_abs_logit']:.2e}) ids_equal={d['ids_equal']}/{r['num_prompts']} "
            f"near_ties={d['near_ties']} divergences={d['divergences']} "
            f"top1={d['first_step_top1_agreement']:.2f} "
            + (" decode tok/s " + _rates(d) + f" prefill512={d['prefill512_ms']:.1f} ms" if _rates(d) else ""),
            flush=True,
        )
        if "graphs" in d:
            g = d["graphs"]
            print(
                f"{name} {dtype} graphs: ok={g['ok']} sizes={g['captured_sizes']} "
                f"startup={g['startup_s']:.1f}s "
                f"ids_equal_cpu={g['ids_equal_cpu']} near_ties={g['near_ties']} divergences={g['divergences']} "
                f"ids_equal_eager={g['ids_equal_eager']}/{r['num_prompts']} decode tok/s {_rates(g)}"
                + "".join(
                    f" b{b}x{g[f'batch{b}_tok_per_s'] / d[f'batch{b}_tok_per_s']:.2f}"
                    for b in (1, 8, 32, 64)
                    if f"batch{b}_tok_per_s" in g and f"batch{b}_tok_per_s" in d
                ),
                flush=True,
            )


def _cpu_side(name, shape, tmp, rng) -> dict:
    t0 = time.perf_counter()
    ref = cpu_reference(name, shape, tmp, rng)
    vocab = ref["shape"].get("vocab_size") or 259
    ok = all(np.isfinite(x).all() for x in ref["logits"]) and all(
        len(i) == ref["params"].max_tokens and all(0 <= t < vocab for t in i) for i in ref["ids"]
    )
    stats = ref["llm"].stats()
    ok = ok and stats["num_free_blocks"] == stats["num_total_blocks"]
    return {"cpu_only": True, "ok": bool(ok), "num_prompts": len(ref["prompts"]), "seconds": time.perf_counter() - t0}


ALL_SHAPES = {**SHAPES, **FEATURE_SHAPES, **MOE_CHECK_SHAPES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--shapes", default="all", help=f"comma-separated, of {', '.join(ALL_SHAPES)}; or 'all'")
    ap.add_argument(
        "--cpu-only", action="store_true", help="run only the CPU engine's side of each shape (no GPU needed)"
    )
    args = ap.parse_args(argv)
    names = list(ALL_SHAPES) if args.shapes == "all" else [n.strip() for n in args.shapes.split(",")]
    unknown = [n for n in names if n not in ALL_SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {list(ALL_SHAPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            shape = ALL_SHAPES[name]
            rng = np.random.default_rng(list(ALL_SHAPES).index(name))  # a shape's prompts, whatever runs with it
            try:
                if args.cpu_only:
                    results[name] = _cpu_side(name, shape, tmp, rng)
                else:
                    timing = () if name in FEATURE_SHAPES or name in MOE_CHECK_SHAPES else (1, 8, 32, 64)
                    graphs = ("float32", "bfloat16") if name == "smollm2-135m-shape" else ()
                    results[name] = check_shape(name, shape, tmp, rng, timing_batches=timing, graphs=graphs)
            except Exception as e:  # report every shape, then fail
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            # each shape's file as soon as it exists: a run cut short still reports what it finished
            (out / f"engine_{name}.json").write_text(json.dumps(results[name], indent=2))
            _print_result(name, results[name])
    (out / "engine_check.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
