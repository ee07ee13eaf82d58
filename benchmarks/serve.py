"""Online serving benchmark (in the spirit of ``vllm bench serve``) against rawpaged's OpenAI API.

Random prompts of exactly ``--input-len`` tokens (token ids drawn with a fixed seed, sent as token-id
prompts) ask for exactly ``--output-len`` tokens (``ignore_eos``) over streaming ``/v1/completions``.
For each concurrency level (or request rate) it reports TTFT, ITL (gap between streamed chunks), TPOT and
end-to-end latency (mean, p50, p99) plus output tokens/s, prints a table and writes JSON with the
conditions (machine, model, lengths, server arguments).

    python benchmarks/serve.py --start-server --input-len 64 --output-len 32 \
        --concurrency 1,8,32 --num-prompts 8,16,32 --out bench_serve.json
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x.strip()]


def make_prompts(num: int, input_len: int, seed: int, low: int, high: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, size=input_len).tolist() for _ in range(num)]


async def one_request(session, url, model, prompt, output_len, headers) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(base_url, model, prompts, output_len, concurrency, request_rate, seed, headers) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed + 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def limited(p):
            async with sem:
                return await one_request(session, url, model, p, output_len, headers)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, concurrency, request_rate)


def _stats(values: list) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(results: list, duration: float, concurrency: int, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "request_rate": None if request_rate == float("inf") else request_rate,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput_per_s": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def print_table(runs: list) -> str:
    head = (
        f"{'conc':>5} {'rate':>6} {'reqs':>5} {'ok':>4} {'out tok/s':>10} "
        f"{'TTFT mean/p50/p99 ms':>24} {'ITL mean/p50/p99 ms':>22} {'E2E mean/p50/p99 ms':>26}"
    )
    lines = [head, "-" * len(head)]

    def f(s):
        return "/".join("-" if s[k] is None else f"{s[k]:.0f}" for k in ("mean", "p50", "p99"))

    for r in runs:
        rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
        lines.append(
            f"{r['concurrency']:>5} {rate:>6} {r['num_prompts']:>5} {r['completed']:>4} "
            f"{r['output_throughput_tok_s']:>10.1f} {f(r['ttft_ms']):>24} {f(r['itl_ms']):>22} "
            f"{f(r['e2e_ms']):>26}"
        )
    text = "\n".join(lines)
    print(text)
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(url, headers=None, timeout=5.0):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url, headers=headers) as r:
            return r.status, await r.text()


def start_server(extra_args: list, timeout: float):
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="rawpaged-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), *extra_args]
    print(f"starting: {' '.join(cmd)} (log: {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read()[-2000:]}")
        try:
            status, _ = asyncio.run(_get(url + "/health", timeout=2.0))
            if status == 200:
                return proc, url, log.name
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit(f"server did not become healthy within {timeout:.0f}s (log: {log.name})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark")
    p.add_argument(
        "--start-server",
        action="store_true",
        help="start `python server.py` on a free port for the run (ignores --base-url)",
    )
    p.add_argument("--server-args", default="--device auto", help="extra arguments for the started server, one string")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send (default: the server's /v1/models)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="comma-separated concurrency levels")
    p.add_argument(
        "--num-prompts",
        type=_ints,
        default=None,
        help="requests per level: one number for all or one per level (default: 4 x concurrency)",
    )
    p.add_argument(
        "--request-rate",
        type=_floats,
        default=None,
        help="comma-separated request rates (req/s, Poisson arrivals); each runs with the concurrency "
        "cap of the matching --concurrency level (or the first)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--token-id-range",
        type=_ints,
        default=[1000, 30000],
        help="prompt token ids are drawn uniformly from [low, high)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    p.add_argument("--out", default="benchmarks/out/serve.json", help="write the results as JSON here")
    args = p.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = None
    server_log = None
    if args.start_server:
        import shlex

        extra = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
        proc, base_url, server_log = start_server(extra, timeout=600)
    else:
        base_url = args.base_url
    try:
        status, text = asyncio.run(_get(base_url + "/v1/models", headers=headers))
        if status != 200:
            raise SystemExit(f"GET /v1/models: HTTP {status}: {text[:200]}")
        card = json.loads(text)["data"][0]
        model = args.model or card["id"]
        if args.request_rate:
            levels = [(args.concurrency[min(i, len(args.concurrency) - 1)], r) for i, r in enumerate(args.request_rate)]
        else:
            levels = [(c, float("inf")) for c in args.concurrency]
        nums = args.num_prompts or [4 * c for c, _ in levels]
        if len(nums) == 1:
            nums = nums * len(levels)
        if len(nums) != len(levels):
            raise SystemExit(f"--num-prompts has {len(nums)} values for {len(levels)} levels")
        low, high = args.token_id_range
        if not args.no_warmup:
            warm = make_prompts(1, args.input_len, args.seed + 999, low, high)
            asyncio.run(run_level(base_url, model, warm, min(args.output_len, 4), 1, float("inf"), 0, headers))
        runs = []
        for i, ((conc, rate), num) in enumerate(zip(levels, nums)):
            prompts = make_prompts(num, args.input_len, args.seed + i, low, high)
            print(f"running concurrency={conc} rate={rate:g} num_prompts={num} ...", file=sys.stderr)
            runs.append(
                asyncio.run(run_level(base_url, model, prompts, args.output_len, conc, rate, args.seed, headers))
            )
        table = print_table(runs)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = {
        "benchmark": "serve",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "conditions": {
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "python": platform.python_version(),
            },
            "model": model,
            "max_model_len": card.get("max_model_len"),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "token_id_range": [low, high],
            "endpoint": "/v1/completions (stream, token-id prompts, ignore_eos)",
            "server": {
                "started_here": bool(proc),
                "args": args.server_args if proc else None,
                "base_url": base_url,
                "log": server_log,
            },
        },
        "runs": runs,
        "table": table,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
