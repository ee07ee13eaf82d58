"""Structured outputs: what a constraint costs (CPU backend, default model).

Measures, in one run:
  * compile: the tokenizer wrapped for llguidance once, then each constraint compiled and validated
    (cache miss) and a matcher made from the cached grammar (cache hit);
  * masking per step at batch 1 and 32: every constrained sequence's bitmask filled (llguidance) plus the
    Numba kernel that writes -inf into its logits row, timed alone, sequences mid-JSON;
  * decode steps with and without a constraint, batches 1 and 32 (``--prompt-len``-token prompts, a JSON
    Schema whose string field outlasts ``--output-len``): median decode-step time, output tok/s, and the
    overhead the constraint adds to a step.

Usage: ``python benchmarks/structured.py [--batches 1 32] [--output-len 32] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rawpaged  # noqa: E402, F401  (before numpy: it configures OpenBLAS and Numba)

# isort: split
import numpy as np  # noqa: E402

from benchmarks.common import best_time, conditions, print_table, write_json  # noqa: E402
from rawpaged import LLM, SamplingParams  # noqa: E402
from rawpaged.kernels.cpu import sampling as cpu_sampling  # noqa: E402
from rawpaged.structured_output import StructuredOutputManager, StructuredOutputsParams  # noqa: E402
from rawpaged.weights import prepare  # noqa: E402

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
MEDIUM = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "shipping": {"oneOf": [{"type": "null"}, {"type": "object", "properties": {"city": {"type": "string"}}}]},
    },
    "required": ["id", "items"],
}
#: decode benchmark: a string that does not end within the output length
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
CONSTRAINTS = {
    "json small": StructuredOutputsParams(json=SMALL),
    "json medium": StructuredOutputsParams(json=MEDIUM),
    "regex": StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
}


def compile_rows(tokenizer, vocab_size, eos) -> tuple[float, list]:
    t0 = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, vocab_size, eos)
    manager.backend  # noqa: B018 - wraps the tokenizer
    wrap = time.perf_counter() - t0
    rows = []
    for name, params in CONSTRAINTS.items():
        t0 = time.perf_counter()
        manager.compile(params)
        miss = time.perf_counter() - t0
        hit = best_time(lambda p=params: manager.compile(p), repeat=3, min_time=0.1)
        rows.append({"constraint": name, "compile_ms": miss * 1e3, "cached_ms": hit * 1e3})
    return wrap, rows


def mask_rows(manager, tokenizer, vocab_size, batches, steps: int = 20) -> list:
    """Per step: the masks of ``batch`` sequences inside a JSON string, each step in a new state (one more
    letter accepted between steps, untimed), and the kernel over their logits rows."""
    prefix = tokenizer.encode_literal('{"text": "')
    letter = tokenizer.encode_literal("a")[0]
    rows = []
    for batch in batches:
        grammars = [manager.compile(StructuredOutputsParams(json=LONG)) for _ in range(batch)]
        for g in grammars:
            assert all(g.accept_token(t) for t in prefix)
        logits = np.zeros((batch, vocab_size), np.float32)
        index = np.arange(batch)
        fills, applies = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            bitmask = manager.grammar_bitmask(grammars)
            t1 = time.perf_counter()
            cpu_sampling.apply_token_bitmask(logits, bitmask, index)
            applies.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
            for g in grammars:
                assert g.accept_token(letter)
        fill, apply = float(np.median(fills)), float(np.median(applies))
        rows.append({"batch": batch, "fill_ms": fill * 1e3, "apply_ms": apply * 1e3, "total_ms": (fill + apply) * 1e3})
    return rows


def decode_rows(llm, batches, prompt_len, output_len, rounds: int = 3) -> list:
    """Decode steps without and with a constraint, alternated (A B A B ...: this host's speed drifts),
    after one warm-up round of each."""
    rng = np.random.default_rng(0)
    eng = llm.engine
    kinds = {"free": None, "json": {"json": LONG}}
    rows = []
    for batch in batches:
        steps = {label: [] for label in kinds}
        for rep in range(2 * (rounds + 1)):
            label = list(kinds)[rep % 2]
            params = SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=kinds[label]
            )
            for _ in range(batch):
                eng.add_request({"prompt_token_ids": rng.integers(1000, 30000, prompt_len).tolist()}, params)
            eng.step()  # the prefill
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                if rep >= 2:
                    steps[label].append(time.perf_counter() - t0)
        row = {"batch": batch}
        for label in kinds:
            step = float(np.median(steps[label]))
            row[f"{label}_step_ms"] = step * 1e3
            row[f"{label}_tok_s"] = batch / step
        row["overhead_pct"] = 100 * (row["json_step_ms"] / row["free_step_ms"] - 1)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/out/structured.json")
    args = ap.parse_args(argv)
    llm = LLM(model=str(prepare()), device="cpu", max_num_seqs=max(args.batches), enable_prefix_caching=False)
    eng = llm.engine
    vocab, eos = eng.model_config.vocab_size, eng.eos_token_ids
    wrap, compiles = compile_rows(eng.tokenizer, vocab, eos)
    print(f"tokenizer wrapped for llguidance in {wrap * 1e3:.0f} ms")
    print_table(compiles, ["constraint", "compile_ms", "cached_ms"])
    masks = mask_rows(eng.structured_output_manager, eng.tokenizer, vocab, args.batches)
    print_table(masks, ["batch", "fill_ms", "apply_ms", "total_ms"])
    decode = decode_rows(llm, args.batches, args.prompt_len, args.output_len)
    print_table(decode, ["batch", "free_step_ms", "json_step_ms", "overhead_pct", "free_tok_s", "json_tok_s"])
    write_json(
        args.out,
        {
            "benchmark": "structured",
            "conditions": conditions(model="SmolLM2-135M-Instruct (float32)", **vars(args)),
            "tokenizer_wrap_ms": wrap * 1e3,
            "compile": compiles,
            "mask": masks,
            "decode": decode,
        },
    )


if __name__ == "__main__":
    main()
