"""Mixtures of experts on the CPU, the measured goals of issue 56 side by side in one run:

- batch-1 decode of a random Mixtral-layout model of a realistic shape (32 experts, top-4, hidden 1024, expert
  FFN 512, 8 layers) against a dense Llama of the same shape whose FFN is the 4 active experts' (intermediate
  2048): time per token, MoE over dense (goal <= 1.3x), F32 (the HF directories) and Q4_K_M (llama-quantize's
  GGUFs of the F32 GGUFs), 512-token prefill beside it;
- the MoE Q4_K_M against ``llama-bench``'s ``tg128``/``pp512`` on the same file and threads (goal >= 1.0x), the
  dense Q4_K_M beside it;
- per-stream speed (1 / TPOT p50) at concurrency 8 against ``llama-server`` on the MoE Q4_K_M
  (``serve.compare_servers``: both servers up, ABBA rounds; goal >= 1.2x);
- resident memory: the absolute RSS of a fresh process after loading the MoE Q4_K_M, against the file's size
  + the KV pool + 0.4 GB.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/moe.py \\
        [--llama-cpp-bin /path/to/llama.cpp/build/bin] [--rounds 3] [--out benchmarks/out/moe.json]

The models share a tokenizer of 256 ASCII tokens (``ascii_tokenizer``), so the logits' product is a small
share of a token's time and the ratio measures the layers. Each round times every engine and model once, in
the reverse order of the round before; ratios are the medians of the rounds' ratios (each round's pairs run
close together, so drift in the shared host's speed falls on both). Where ``--llama-cpp-bin`` has no
``llama-quantize`` the Q4_K_M rows are skipped, and without ``llama-bench``/``llama-server`` their columns.
``--quick``: a tiny shape and short runs (the test's).
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

from benchmarks import serve  # noqa: E402
from benchmarks.common import conditions, fresh_process_memory, print_table, write_json  # noqa: E402

THREADS = 2
#: the layers both models share: Llama-like attention with head_dim 128 and 4 groups of 2 KV heads
SHAPE = dict(num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128)
MOE_SHAPE = dict(SHAPE, architecture="MixtralForCausalLM", intermediate_size=512, num_experts=32, num_experts_per_tok=4)
DENSE_SHAPE = dict(SHAPE, architecture="LlamaForCausalLM", intermediate_size=4 * 512)
#: ``--quick``: widths multiples of 256 (llama-quantize's K-quants)
QUICK_SHAPE = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
QUICK_MOE = dict(QUICK_SHAPE, architecture="MixtralForCausalLM", intermediate_size=256, num_experts=4)
QUICK_DENSE = dict(QUICK_SHAPE, architecture="LlamaForCausalLM", intermediate_size=2 * 256)
#: tokens: (decode, prompt before the decode, prefill); quick: (16, 8, 64)
SIZES = (128, 20, 512)
QUICK_SIZES = (16, 8, 64)
#: prompts draw token ids from [LOW_TOKEN, VOCAB): past the 3 special tokens of ``ascii_tokenizer``'s
LOW_TOKEN, VOCAB = 3, 256
SERVE_CONCURRENCY = 8
RSS_SLACK_BYTES = 400_000_000
ENGINE_ARGS = {"num_kv_blocks": 256, "max_model_len": 2048}
#: the goals, as (metric, (direction, bound)); "<=" on a ratio of times, ">=" on a ratio of speeds
GOALS = {
    "decode_ms_f32": ("<=", 1.3),
    "decode_ms_q4_k_m": ("<=", 1.3),
    "decode_tok_s_vs_llama_cpp": (">=", 1.0),
    "prefill_tok_s_vs_llama_cpp": (">=", 1.0),
    "c8_per_stream_tok_s": (">=", 1.2),
    "rss_after_load_bytes": ("<=", 1.0),
}


def prepare_models(models_dir: Path, quick: bool, llama_quantize) -> dict:
    """The four models (``moe_f32``, ``dense_f32`` HF directories; ``moe_q4``, ``dense_q4`` GGUF files where
    ``llama_quantize`` is a binary), written once under ``models_dir`` and reused."""
    from rawpaged.testing.random_model import write_random_model
    from rawpaged.testing.random_moe_gguf import llama_quantize as quantize
    from rawpaged.testing.random_moe_gguf import write_moe_gguf

    shapes = {"moe": QUICK_MOE if quick else MOE_SHAPE, "dense": QUICK_DENSE if quick else DENSE_SHAPE}
    tokenizer = ascii_tokenizer(models_dir / "tokenizer")
    out = {}
    for name, shape in shapes.items():
        tag = "-".join(f"{v}" for k, v in sorted(shape.items()) if k != "architecture")
        hf = models_dir / f"{name}-{tag}"
        if not (hf / "config.json").is_file():
            write_random_model(hf, tokenizer_from=tokenizer, **shape)
        out[f"{name}_f32"] = hf
        if llama_quantize is None:
            continue
        q4 = models_dir / f"{name}-{tag}.Q4_K_M.gguf"
        if not q4.is_file():
            f32 = write_moe_gguf(hf, models_dir / f"{name}-{tag}.F32.gguf")
            quantize(f32, q4, "Q4_K_M", tool=llama_quantize, threads=THREADS)
            f32.unlink()
        out[f"{name}_q4"] = q4
    return out


def ascii_tokenizer(dst: Path) -> Path:
    """A byte-level BPE tokenizer of ``VOCAB`` tokens that all decode to whole ASCII text: 3 specials, the
    printable ASCII characters, space and newline, then two-character merges. Random models emit random
    tokens; a token of half a UTF-8 character would stream no text (llama-server holds it back), and
    llama.cpp refuses a BPE vocabulary without merges. Written to ``dst`` (a folder, with ``random_model``'s
    tokenizer_config.json) once; returns it."""
    from rawpaged.testing.random_model import write_random_model

    if (dst / "tokenizer.json").is_file():
        return dst
    write_random_model(dst, num_layers=1)  # the tiny model's byte tokenizer and its config
    tok = json.loads((dst / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    base = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]  # GPT-2's byte alphabet: space and newline mapped
    vocab = dict(specials) | {ch: len(specials) + i for i, ch in enumerate(base)}
    merges = []
    for a, b in ((a, b) for a in ["Ġ"] + base[:-2] for b in base[32:58] + base[64:90]):  # letters after
        if len(vocab) == VOCAB:
            break
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
    tok["model"]["vocab"], tok["model"]["merges"] = vocab, merges
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


class Ours:
    """Our engine on ``model`` (CPU, ``ENGINE_ARGS``), every path compiled, with :meth:`measure` timing
    batch-1 decode and prefill on fresh random prompts of ids in [``LOW_TOKEN``, ``VOCAB``)."""

    def __init__(self, model: Path, sizes: tuple):
        from rawpaged import LLM

        self.llm = LLM(model=str(model), device="cpu", **ENGINE_ARGS)
        self.decode, self.prompt, self.prefill = sizes
        self.seed = 0
        self._run(self._tokens(self.prefill), 2)  # compile every path once
        self._run(self._tokens(self.prompt), 4)

    def _tokens(self, n: int) -> list:
        import numpy as np

        self.seed += 1
        return np.random.default_rng(self.seed).integers(LOW_TOKEN, VOCAB, n).tolist()

    def _run(self, prompt: list, n: int) -> float:
        from rawpaged import SamplingParams

        t = time.perf_counter()
        self.llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    def measure(self) -> dict:
        """``decode_tok_s``: ``decode`` tokens after a short prompt, less the prompt and first token alone;
        ``prefill_tok_s``: one ``prefill``-token prompt to its first token."""
        first = self._run(self._tokens(self.prompt), 1)
        whole = self._run(self._tokens(self.prompt), 1 + self.decode)
        prefill = self._run(self._tokens(self.prefill), 1)
        return {"decode_tok_s": self.decode / (whole - first), "prefill_tok_s": self.prefill / prefill}


def llama_bench(binary: Path, gguf: Path, sizes: tuple) -> dict:
    """llama.cpp's tok/s for ``tg<decode>`` and ``pp<prefill>`` (one run of each, ``-r 1``)."""
    decode, _, prefill = sizes
    cmd = [str(binary), "-m", str(gguf), "-t", str(THREADS), "-p", str(prefill), "-n", str(decode), "-r", "1"]
    rows = json.loads(subprocess.run(cmd + ["-o", "json"], capture_output=True, text=True, check=True).stdout)
    tg = next(r for r in rows if r["n_gen"] == decode)
    pp = next(r for r in rows if r["n_prompt"] == prefill)
    return {"decode_tok_s": tg["avg_ts"], "prefill_tok_s": pp["avg_ts"], "build": rows[0].get("build_commit")}


#: a round's order: each pair of a ratio close together
ORDER = ("ours_moe_f32", "ours_dense_f32", "ours_dense_q4", "ours_moe_q4", "llama_cpp_moe_q4", "llama_cpp_dense_q4")


def timed_rounds(models: dict, bench, rounds: int, sizes: tuple) -> dict:
    """Each engine and model's measurements, ``rounds`` of them, each round in the reverse order of the one
    before: ``ours_<model>`` for every model, ``llama_cpp_<model>`` for the GGUFs where ``bench`` is
    llama-bench."""
    jobs = {f"ours_{name}": Ours(path, sizes).measure for name, path in models.items()}
    if bench is not None:
        for name in ("moe_q4", "dense_q4"):
            if name in models:
                jobs[f"llama_cpp_{name}"] = lambda path=models[name]: llama_bench(bench, path, sizes)
    order = [n for n in ORDER if n in jobs]
    runs = {name: [] for name in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            print(f"round {r + 1}: {name} ...", file=sys.stderr)
            runs[name].append(jobs[name]())
    return runs


def memory(gguf: Path) -> dict:
    """``common.fresh_process_memory`` on ``gguf`` with the budget of the goal: file + pool +
    ``RSS_SLACK_BYTES``."""
    res = fresh_process_memory(gguf, ENGINE_ARGS, env=serve.bench_env())
    res["budget_bytes"] = res["file_bytes"] + res["kv_pool_bytes"] + RSS_SLACK_BYTES
    return res


def serving(gguf: Path, llama_server: Path, rounds: int, quick: bool) -> dict:
    """``serve.compare_servers`` at concurrency 8: 16 requests of 64 prompt and 64 output tokens a round
    (quick: 8 of 16 and 16)."""
    n = 16 if quick else 64
    args = serve.main_parser().parse_args(
        [
            "--compare-llama-server",
            str(llama_server),
            "--compare-gguf",
            str(gguf),
            "--compare-rounds",
            str(rounds),
            "--concurrency",
            str(SERVE_CONCURRENCY),
            "--num-prompts",
            str(SERVE_CONCURRENCY if quick else 2 * SERVE_CONCURRENCY),
            "--input-len",
            str(n),
            "--output-len",
            str(n),
            "--token-id-range",
            f"{LOW_TOKEN},{VOCAB}",
            "--server-args=--max-model-len 2048",
        ]
    )
    return serve.compare_servers(args)


def med(runs: list, key: str) -> float:
    return statistics.median(r[key] for r in runs)


def median_ratio(a: list, b: list, key: str) -> float:
    """The median over rounds of ``a[i][key] / b[i][key]``."""
    return statistics.median(ra[key] / rb[key] for ra, rb in zip(a, b))


def table(runs: dict, served: dict | None, mem: dict | None) -> list:
    """The rows: metric, rawpaged (MoE), reference (dense, llama.cpp or the memory budget), ratio, goal."""
    rows = []
    for fmt, suffix in (("f32", "f32"), ("q4", "q4_k_m")):
        moe, dense = runs.get(f"ours_moe_{fmt}"), runs.get(f"ours_dense_{fmt}")
        if moe is None:
            continue
        for key, metric in (("decode_tok_s", "decode_ms"), ("prefill_tok_s", "prefill_ms")):
            rows.append(
                {
                    "metric": f"{metric}_{suffix}",
                    "rawpaged": 1000.0 / med(moe, key),
                    "reference": 1000.0 / med(dense, key),
                    "vs": "dense",
                    "ratio": median_ratio(dense, moe, key),  # of speeds: the MoE's time over the dense one's
                }
            )
    for name, label in (("moe_q4", ""), ("dense_q4", "_dense")):
        theirs = runs.get(f"llama_cpp_{name}")
        if theirs is None:
            continue
        ours = runs[f"ours_{name}"]
        for key in ("decode_tok_s", "prefill_tok_s"):
            r = {"metric": f"{key}_vs_llama_cpp{label}", "rawpaged": med(ours, key), "reference": med(theirs, key)}
            rows.append(r | {"vs": "llama-bench", "ratio": median_ratio(ours, theirs, key)})
    if served is not None:
        c8 = next(r for r in served["comparison"] if r["concurrency"] == SERVE_CONCURRENCY)
        ours, theirs = (1000.0 / c8["tpot_p50_ms"][k] for k in ("rawpaged", "llama_server"))
        rows.append(
            {"metric": "c8_per_stream_tok_s", "rawpaged": ours, "reference": theirs, "vs": "llama-server"}
            | {"ratio": ours / theirs}
        )
    if mem is not None:
        got, budget = mem["rss_after_load_bytes"], mem["budget_bytes"]
        rows.append(
            {"metric": "rss_after_load_bytes", "rawpaged": got / 1e6, "reference": budget / 1e6, "vs": "budget MB"}
            | {"ratio": got / budget}
        )
    for r in rows:
        if r["metric"] in GOALS:
            op, bound = GOALS[r["metric"]]
            r["goal"] = f"{op} {bound}x"
            r["met"] = r["ratio"] <= bound if op == "<=" else r["ratio"] >= bound
    return rows


def default_llama_cpp_bin() -> Path | None:
    """The bin folder of the llama.cpp build ``scripts/q4_k_m_check.py`` makes, if any."""
    from rawpaged.testing.random_moe_gguf import find_llama_quantize

    found = find_llama_quantize()
    return found.parent if found is not None else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=None,
        help="llama.cpp's build/bin (llama-quantize, llama-bench, llama-server); default: the q4_k_m_check build",
    )
    p.add_argument("--models-dir", type=Path, default=ROOT / "benchmarks" / "out" / "moe_models")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a tiny shape and short runs")
    p.add_argument("--no-serving", action="store_true", help="skip the llama-server comparison")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "moe.json")
    args = p.parse_args(argv)
    bin_dir = args.llama_cpp_bin or default_llama_cpp_bin()
    tools = {n: bin_dir / n for n in ("llama-quantize", "llama-bench", "llama-server")} if bin_dir else {}
    tools = {n: path for n, path in tools.items() if path.is_file()}
    sizes = QUICK_SIZES if args.quick else SIZES
    models = prepare_models(args.models_dir, args.quick, tools.get("llama-quantize"))

    mem = memory(models["moe_q4"]) if "moe_q4" in models else None
    runs = timed_rounds(models, tools.get("llama-bench"), args.rounds, sizes)
    served = None
    if "moe_q4" in models and "llama-server" in tools and not args.no_serving:
        served = serving(models["moe_q4"], tools["llama-server"], max(2, args.rounds - 1), args.quick)
    rows = table(runs, served, mem)
    print_table(rows, ["metric", "rawpaged", "reference", "vs", "ratio", "goal", "met"])
    print("ms rows: ms per token of the MoE beside the dense model (rawpaged both), ratio MoE / dense;")
    print("tok/s rows: the MoE Q4_K_M (_dense: the dense Q4_K_M) beside llama.cpp, ratio ours / theirs")
    if mem is not None:
        print(
            f"RSS of a fresh process: {mem['rss_after_import_bytes'] / 1e6:.0f} MB after importing rawpaged, "
            f"{mem['rss_after_load_bytes'] / 1e6:.0f} MB after load, {mem['rss_after_generate_bytes'] / 1e6:.0f} "
            f"MB after a generation (file {mem['file_bytes'] / 1e6:.0f} MB, "
            f"KV pool {mem['kv_pool_bytes'] / 1e6:.0f} MB)"
        )
    build = next((r[0]["build"] for n, r in runs.items() if n.startswith("llama_cpp")), None)
    cond = conditions(
        threads=THREADS,
        shapes={"moe": QUICK_MOE if args.quick else MOE_SHAPE, "dense": QUICK_DENSE if args.quick else DENSE_SHAPE},
        files={name: {"path": str(path), "bytes": _size(path)} for name, path in models.items()},
        tokens={"decode": sizes[0], "prompt_before_decode": sizes[1], "prefill": sizes[2]},
        llama_cpp=str(bin_dir) if bin_dir else None,
        llama_cpp_tools=sorted(tools),
        llama_cpp_build=build,
        rounds=args.rounds,
        load_average=os.getloadavg(),
    )
    cond["openblas_env_unset"] = "OPENBLAS_CORETYPE" not in os.environ and "OPENBLAS_L2_SIZE" not in os.environ
    write_json(args.out, {"conditions": cond, "table": rows, "rounds": runs, "memory": mem, "serving": served})
    return 0


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


if __name__ == "__main__":
    sys.exit(main())
