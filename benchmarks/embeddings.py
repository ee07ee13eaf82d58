"""Embedding throughput beside llama.cpp (issue 59's goal: at least 1.5x ``llama-server --embeddings`` on the
same model and threads), both servers up, the same client load against each, rounds alternating which goes
first.

The load: ``--num-inputs`` texts of about ``--input-len`` tokens each (random vocabulary pieces of the
default model, so both servers tokenize the same text to about the same tokens), sent to ``/v1/embeddings``
in requests of ``--batch`` inputs, ``--concurrency`` requests at once. Throughput is the prompt tokens the
servers report (``usage.prompt_tokens``) over the wall time. Both pool the last token and L2-normalize
(``--pooling last``; llama-server's default ``--embd-normalize 2``, our default), on the default model's F32
GGUF (the very float32 weights our prepared model holds). The vectors' cosine agreement between the two is
printed as a sanity check.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/embeddings.py --llama-server PATH \\
        [--num-inputs 512] [--input-len 128] [--batch 16] [--concurrency 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serve  # noqa: E402
from benchmarks.common import conditions, print_table, write_json  # noqa: E402

GOAL = 1.5
THREADS = 2


def make_texts(num: int, input_len: int, seed: int) -> list:
    """``num`` texts of about ``input_len`` tokens: random pieces of the default model's vocabulary, decoded."""
    from rawpaged.tokenizer import Tokenizer
    from rawpaged.weights import prepare

    tok = Tokenizer(prepare(progress=True))
    rng = np.random.default_rng(seed)
    return [tok.decode(rng.integers(200, 40000, input_len).tolist()) for _ in range(num)]


async def _embed_all(url: str, texts: list, batch: int, concurrency: int) -> dict:
    slots = asyncio.Semaphore(concurrency)
    tokens, vectors = 0, [None] * len(texts)

    async def one(session, start):
        nonlocal tokens
        async with slots:
            body = {"input": texts[start : start + batch], "encoding_format": "float"}  # the served model
            async with session.post(url + "/v1/embeddings", json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise SystemExit(f"{url}: HTTP {r.status}: {str(data)[:300]}")
        tokens += data["usage"]["prompt_tokens"]
        for item in data["data"]:
            vectors[start + item["index"]] = item["embedding"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(one(session, s) for s in range(0, len(texts), batch)))
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "vectors": np.asarray(vectors, np.float32)}


def start_llama_server(binary: str, gguf: Path, slots: int, ctx_per_slot: int, timeout: float):
    port = serve._free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--embeddings", "--pooling", "last"]
    cmd += ["-np", str(slots), "-c", str(slots * ctx_per_slot), "-b", "2048", "-ub", "2048"]
    cmd += ["-t", str(THREADS), "-tb", str(THREADS), "--no-webui"]
    proc, log = serve._launch(cmd, "llama-server", timeout, url)
    return proc, url, log


def main(argv=None) -> int:
    from rawpaged import weights as rp_weights

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="a llama-server binary built for this host")
    p.add_argument("--num-inputs", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="inputs per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "embeddings.json")
    args = p.parse_args(argv)
    gguf = rp_weights.default_f32_gguf_path()
    texts = make_texts(args.num_inputs, args.input_len, 0)
    slots = args.batch * args.concurrency
    ours_args = ["--model", str(gguf), "--max-num-seqs", str(slots), "--max-num-batched-tokens", "4096"]
    procs = []
    try:
        ours = serve.start_server(ours_args, args.timeout, env=serve.bench_env())
        procs.append(ours[0])
        theirs = start_llama_server(args.llama_server, gguf, slots, 2 * args.input_len, args.timeout)
        procs.append(theirs[0])
        sides = {"rawpaged": ours[1], "llama.cpp": theirs[1]}
        for url in sides.values():  # warm-up: compile, first allocations
            asyncio.run(_embed_all(url, texts[: 2 * args.batch], args.batch, args.concurrency))
        runs = {name: [] for name in sides}
        last = {}
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                res = asyncio.run(_embed_all(sides[name], texts, args.batch, args.concurrency))
                runs[name].append(res["tok_s"])
                last[name] = res
    finally:
        for proc in procs:
            serve.stop(proc)
    a, b = last["rawpaged"]["vectors"], last["llama.cpp"]["vectors"]
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    ours_tok_s, theirs_tok_s = statistics.median(runs["rawpaged"]), statistics.median(runs["llama.cpp"])
    ratio = ours_tok_s / theirs_tok_s
    rows = [
        {"side": "rawpaged", "tok_s": ours_tok_s, "prompt_tokens": last["rawpaged"]["tokens"]},
        {"side": "llama.cpp", "tok_s": theirs_tok_s, "prompt_tokens": last["llama.cpp"]["tokens"]},
    ]
    print_table(rows, ["side", "tok_s", "prompt_tokens"])
    print(
        f"ratio {ratio:.2f}x (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'not met'}); "
        f"cosine(ours, llama.cpp) min {cosine.min():.5f}, median {np.median(cosine):.5f}"
    )
    cond = conditions(
        threads=THREADS,
        num_inputs=args.num_inputs,
        input_len=args.input_len,
        batch=args.batch,
        concurrency=args.concurrency,
        rounds=args.rounds,
        gguf=str(gguf),
        llama_server=args.llama_server,
    )
    write_json(
        args.out,
        {
            "conditions": cond,
            "rounds": runs,
            "rows": rows,
            "ratio": ratio,
            "cosine_min": float(cosine.min()),
            "cosine_median": float(np.median(cosine)),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
