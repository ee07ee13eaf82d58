"""Offline throughput of the engine on the default model (CPU backend), and HF transformers beside it
when ``transformers`` is importable (optional, never a dependency).

Measures, in one run:
  * prefill: one prompt of ``--prefill-len`` tokens, ``max_tokens=1``: prompt tokens / time;
  * decode at batch 1, 8, 32, 64: ``--prompt-len``-token prompts, ``--output-len`` new tokens each
    (``ignore_eos``, greedy), all submitted at once: aggregate output tok/s over the whole run, and
    decode-only tok/s from the steps that ran no prefill;
  * Python overhead per decode step: the same engine over a model with the default model's layer
    count and vocabulary but tiny hidden sizes (hidden 72, 9/3 heads of dim 8, intermediate 64), where
    the math costs almost nothing, so the step time is the engine's and model code's own overhead.

``--llama-cpp`` adds llama.cpp (the ``llama-cpp-python`` package, benchmark-only) on every ``.gguf`` model:
the same file, prompt lengths and 2 threads, batch 1; for ``default`` it runs on an F32 GGUF of the same
weights (the Q4_1 file dequantized, written once beside the model; equal to the float32 safetensors).
``--model`` takes several models, measured one after another in the same run: ``default`` (the prepared
float32 model), ``default-gguf`` (its original Q4_1 GGUF file, computed on its blocks), or a path to a
model directory or ``.gguf`` file; ``--quantization q8_0`` quantizes the safetensors ones on load.

Usage: ``python benchmarks/offline_throughput.py [--model default default-gguf] [--quantization q8_0]
[--batches 1 8 32 64] [--out DIR] [--no-hf]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rawpaged  # noqa: E402, F401  (before numpy: it configures OpenBLAS and Numba)

# isort: split
import numpy as np  # noqa: E402

from benchmarks.common import conditions, print_table, read_bandwidth, write_json  # noqa: E402
from rawpaged import LLM, SamplingParams  # noqa: E402
from rawpaged import weights as rp_weights  # noqa: E402
from rawpaged.testing.random_model import SHAPES, write_random_model  # noqa: E402


def random_prompts(rng, n, length, vocab=49152, low=100):
    return [{"prompt_token_ids": rng.integers(low, vocab, length).tolist()} for _ in range(n)]


def timed_generate(llm, prompts, params):
    """Runs the engine step by step; returns (elapsed s, generated tokens, decode-only s, decode tokens)."""
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, params)
    generated = decode_tokens = 0
    decode_time = 0.0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        prefilling = any(s.is_prefill for s in eng.scheduler.running) or bool(eng.scheduler.waiting)
        ts = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - ts
        n_new = len(outs)  # one token per running request per decode step (n=1)
        generated += n_new
        if not prefilling:
            decode_time += dt
            decode_tokens += n_new
    return time.perf_counter() - t0, generated, decode_time, decode_tokens


def resolve_model(name: str) -> Path:
    if name == "default":
        return rp_weights.prepare(progress=True)
    if name == "default-gguf":
        return rp_weights.default_gguf_path(progress=True)
    return Path(name)


def bench_rawpaged(model_dir, batches, prompt_len, output_len, prefill_len, rng, label="rawpaged", quantization=None):
    llm = LLM(
        model=str(model_dir),
        quantization=quantization,
        device="cpu",
        max_num_seqs=max(batches),
        max_model_len=2048,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, prefill_len),
    )
    for n in (2, 1):  # JIT warm-up: prefill and decode paths at batch > 1 and at batch 1 (the GEMVs)
        llm.generate(random_prompts(rng, n, 16), SamplingParams(max_tokens=3))
    rows = []
    prompt = random_prompts(rng, 1, prefill_len)
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    rows.append(
        dict(
            engine=label,
            case=f"prefill {prefill_len}",
            batch=1,
            tok_per_s=prefill_len / (time.perf_counter() - t0),
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for b in batches:
        elapsed, gen, dec_t, dec_n = timed_generate(llm, random_prompts(rng, b, prompt_len), params)
        rows.append(
            dict(
                engine=label,
                case=f"generate {prompt_len}+{output_len}",
                batch=b,
                tok_per_s=gen / elapsed,
                decode_tok_per_s=dec_n / dec_t if dec_t else None,
            )
        )
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    weight_bytes = decode_weight_bytes(llm.engine.model)
    for row in rows:
        row["weight_bytes"] = weight_bytes
    return rows


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step streams: every layer's weights, the final norm and the LM head
    (the embedding table is read one row per token, so it counts only when it is the tied head)."""
    arrays = [v for layer in model.layers for v in layer.values() if v is not None]
    return sum(int(a.nbytes) for a in arrays + [model.norm, model.lm_head])


def step_overhead(model_dir, rng, batches=(1, 32), steps=64):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        tiny = write_random_model(
            Path(tmp) / "tiny",
            **{**SHAPES["tiny"], "num_layers": cfg["num_hidden_layers"]},
            tokenizer_from=model_dir,
        )
        llm = LLM(model=str(tiny), device="cpu", max_num_seqs=64, num_kv_blocks=1024, enable_prefix_caching=False)
        llm.generate(random_prompts(rng, 2, 16), SamplingParams(max_tokens=2))
        for b in batches:
            elapsed, gen, dec_t, dec_n = timed_generate(
                llm, random_prompts(rng, b, 16), SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
            )
            rows.append(dict(batch=b, ms_per_decode_step=1e3 * dec_t / (dec_n / b)))
    return rows


def bench_llama_cpp(gguf_path, prompt_len, output_len, prefill_len, rng, threads=2):
    """llama.cpp on the same GGUF file (``llama-cpp-python``, benchmark-only, never a dependency): prefill
    of ``prefill_len`` tokens and batch-1 greedy decode, ``threads`` threads."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=max(1024, prefill_len + 8), n_threads=threads, verbose=False)
    name = f"llama.cpp {Path(gguf_path).stem}"
    prompt = rng.integers(100, 49152, prefill_len).tolist()
    llm.reset()
    llm.eval(prompt[:16])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    rows = [
        dict(engine=name, case=f"prefill {prefill_len}", batch=1, tok_per_s=prefill_len / (time.perf_counter() - t0))
    ]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(rng.integers(100, 49152, prompt_len).tolist())
    t1 = time.perf_counter()
    for _ in range(output_len):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    t2 = time.perf_counter()
    rows.append(
        dict(
            engine=name,
            case=f"generate {prompt_len}+{output_len}",
            batch=1,
            tok_per_s=output_len / (t2 - t0),
            decode_tok_per_s=output_len / (t2 - t1),
        )
    )
    return rows


def bench_hf(model_dir, batches, prompt_len, output_len, prefill_len, rng):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        ids = torch.tensor([rng.integers(100, 49152, prefill_len).tolist()])
        model(ids)  # warm-up
        t0 = time.perf_counter()
        model(ids)
        rows.append(
            dict(
                engine="hf-transformers",
                case=f"prefill {prefill_len}",
                batch=1,
                tok_per_s=prefill_len / (time.perf_counter() - t0),
            )
        )
        for b in batches:
            ids = torch.tensor([rng.integers(100, 49152, prompt_len).tolist() for _ in range(b)])
            t0 = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=2,
            )
            rows.append(
                dict(
                    engine="hf-transformers",
                    case=f"generate {prompt_len}+{output_len}",
                    batch=b,
                    tok_per_s=b * output_len / (time.perf_counter() - t0),
                )
            )
    return rows


def _llama_cpp_version() -> str:
    try:
        import llama_cpp
    except ImportError as e:
        return f"not importable ({e.name})"
    return f"llama-cpp-python {llama_cpp.__version__}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers even if importable")
    ap.add_argument("--model", nargs="+", default=["default"], help="default, default-gguf, or paths")
    ap.add_argument("--quantization", default=None, choices=["gguf", "q8_0"])
    ap.add_argument(
        "--llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on each .gguf model, batch 1"
    )
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    model_dir = rp_weights.prepare(progress=True)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.model:
        path = resolve_model(name)
        quant = args.quantization if path.is_dir() else None
        label = f"rawpaged {name}" + (f" {quant}" if quant else "")
        rows += bench_rawpaged(
            path, args.batches, args.prompt_len, args.output_len, args.prefill_len, rng, label, quant
        )
        peer = path if path.suffix == ".gguf" else rp_weights.default_f32_gguf_path() if name == "default" else None
        if args.llama_cpp and peer is not None:
            try:
                peer_rows = bench_llama_cpp(peer, args.prompt_len, args.output_len, args.prefill_len, rng)
                rows += [dict(r, weight_bytes=rows[-1]["weight_bytes"]) for r in peer_rows]  # the same weights
            except ImportError as e:
                print(f"llama.cpp: not importable ({e.name}); pip install llama-cpp-python to compare")
    hf_note = "skipped (--no-hf)" if args.no_hf else None
    if not args.no_hf:
        try:
            rows += bench_hf(model_dir, args.batches, args.prompt_len, args.output_len, args.prefill_len, rng)
        except ImportError as e:
            hf_note = f"not importable ({e.name})"
    ceiling = read_bandwidth()
    for r in rows:  # batch-1 decode streams every weight once per token
        if r["batch"] == 1 and r.get("decode_tok_per_s") and r.get("weight_bytes"):
            r["weights_GBps"] = r["weight_bytes"] * r["decode_tok_per_s"] / 1e9
            r["of_read_ceiling"] = r["weights_GBps"] / (ceiling / 1e9)
    print_table(rows, ["engine", "case", "batch", "tok_per_s", "decode_tok_per_s", "weights_GBps", "of_read_ceiling"])
    print(f"read-only memory bandwidth (parallel sum of 512 MiB, best of 10): {ceiling / 1e9:.1f} GB/s")
    if hf_note:
        print(f"HF transformers: {hf_note}")
    overhead = step_overhead(model_dir, rng)
    print("\nPython overhead per decode step (tiny-width model, 30 layers, vocab 49152):")
    print_table(overhead, ["batch", "ms_per_decode_step"])
    write_json(
        Path(args.out) / "offline_throughput.json",
        {
            "conditions": conditions(
                model="SmolLM2-135M-Instruct",
                models=args.model,
                read_bandwidth_GBps=ceiling / 1e9,
                quantization=args.quantization,
                dtype="float32 activations",
                kv_cache_dtype="float32",
                block_size=16,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                prefill_len=args.prefill_len,
                sampling="greedy, ignore_eos",
                hf_transformers=hf_note or "measured side by side",
                llama_cpp=_llama_cpp_version() if args.llama_cpp else "not run (--llama-cpp)",
            ),
            "rows": rows,
            "step_overhead": overhead,
        },
    )


if __name__ == "__main__":
    main()
