"""``rawpaged run-batch`` against the same load through the server (issue 59's goal: at least 0.9x the
server's token throughput at its best concurrency), side by side in one run.

The load: ``--num-requests`` short chat requests (a question from a fixed list with its number, greedy,
exactly ``--max-tokens`` tokens with ``ignore_eos``). The server (``python server.py``, the same engine
options) gets them as non-streamed ``/v1/chat/completions`` at each ``--concurrency`` level; run-batch
(``python -m rawpaged run-batch``) gets the same lines as a file. Throughput is completion tokens over
the wall time of the requests: for run-batch the run's own seconds from its summary line (its model
load and warm-up excluded, as the server's are). Rounds alternate which side goes first.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/run_batch.py \\
        [--num-requests 1000] [--max-tokens 16] [--concurrency 16,32,64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serve  # noqa: E402
from benchmarks.common import conditions, print_table, write_json  # noqa: E402

GOAL = 0.9
#: run-batch's last stderr line (``cli.run_batch_main``): lines succeeded and failed, tokens, seconds
SUMMARY = re.compile(r"(\d+) succeeded, (\d+) failed.*?(\d+) tokens in ([\d.]+)s")
QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number.",
    "Give me a synonym for happy.",
    "What colour is the sky?",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
]


def chat_bodies(n: int, max_tokens: int) -> list:
    """``n`` chat request bodies (see the module's docstring)."""
    return [
        {
            "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


async def _through_server(url: str, bodies: list, concurrency: int) -> tuple:
    slots = asyncio.Semaphore(concurrency)
    tokens, failed = 0, 0

    async def one(session, body):
        nonlocal tokens, failed
        async with slots, session.post(url + "/v1/chat/completions", json=body) as r:
            data = await r.json()
            if r.status == 200:
                tokens += data["usage"]["completion_tokens"]
            else:
                failed += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(one(session, b) for b in bodies))
    return tokens, time.perf_counter() - t0, failed


def server_levels(engine_args: list, bodies: list, levels: list, timeout: float) -> dict:
    """``{concurrency: (tokens, seconds, failed)}`` through one server process."""
    proc, url, _log = serve.start_server(engine_args, timeout, env=serve.bench_env())
    try:
        asyncio.run(_through_server(url, bodies[: max(levels)], max(levels)))  # warm the batch shapes
        return {c: asyncio.run(_through_server(url, bodies, c)) for c in levels}
    finally:
        serve.stop(proc)


def run_batch(engine_args: list, bodies: list, model: str, concurrency: int | None) -> tuple:
    """``(tokens, seconds, failed)`` of ``rawpaged run-batch`` on the bodies as a file."""
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        lines = [
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {**b, "model": model}}
            )
            for i, b in enumerate(bodies)
        ]
        path_in.write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "rawpaged", "run-batch", "-i", str(path_in), "-o", str(path_out), *engine_args]
        cmd += ["--max-concurrency", str(concurrency)] if concurrency else []
        done = subprocess.run(cmd, capture_output=True, text=True, env=serve.bench_env(), cwd=ROOT)
        summary = SUMMARY.search(done.stderr)
        if done.returncode != 0 or summary is None:
            raise SystemExit(f"run-batch failed ({done.returncode}): {done.stderr[-2000:]}")
        _ok, failed, tokens, seconds = summary.groups()
        return int(tokens), float(seconds), int(failed)


def _row(side: str, runs: list) -> dict:
    """A table row: the median tokens/s of ``runs`` (``(tokens, seconds, failed)`` per round)."""
    return {"side": side, "tok_s": statistics.median(t / s for t, s, _ in runs), "failed": sum(f for *_, f in runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", default="16,32,64", help="the server's levels")
    p.add_argument("--batch-concurrency", type=int, default=None, help="run-batch's --max-concurrency")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engine-args", default="", help="engine options for both sides, e.g. '--max-num-seqs 32'")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "run_batch.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine_args = args.engine_args.split()
    bodies = chat_bodies(args.num_requests, args.max_tokens)
    rounds = []
    for r in range(args.rounds):
        sides = ["server", "run-batch"] if r % 2 == 0 else ["run-batch", "server"]
        got = {}
        for side in sides:
            if side == "server":
                got["server"] = server_levels(engine_args, bodies, levels, args.timeout)
            else:
                got["run-batch"] = run_batch(engine_args, bodies, "SmolLM2-135M-Instruct", args.batch_concurrency)
        rounds.append(got)
    rows = [_row(f"server c={c}", [rd["server"][c] for rd in rounds]) for c in levels]
    best = max(rows, key=lambda row: row["tok_s"])
    rows.append(_row("run-batch", [rd["run-batch"] for rd in rounds]))
    ratio = rows[-1]["tok_s"] / best["tok_s"]
    print_table(rows, ["side", "tok_s", "failed"])
    verdict = "met" if ratio >= GOAL else "not met"
    print(f"run-batch / best server level ({best['side']}): {ratio:.2f}x (goal >= {GOAL}x: {verdict})")
    run_conditions = conditions(
        num_requests=args.num_requests, max_tokens=args.max_tokens, engine_args=engine_args, rounds=args.rounds
    )
    per_round = [
        {"server": {str(c): v for c, v in rd["server"].items()}, "run_batch": rd["run-batch"]} for rd in rounds
    ]
    write_json(
        args.out, {"conditions": run_conditions, "rounds": per_round, "rows": rows, "ratio_vs_best_server": ratio}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
