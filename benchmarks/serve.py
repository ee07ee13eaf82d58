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
import shlex
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
    dropped_early: bool = False
    retries: int = 0


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x.strip()]


def make_prompts(num: int, input_len: int, seed: int, low: int, high: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, size=input_len).tolist() for _ in range(num)]


#: Errors that mean the peer closed a kept-alive connection before answering: retried on a fresh one.
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def one_request(session, url, model, prompt, output_len, headers, retries: int = 2) -> Result:
    """One streaming request; when the peer drops a kept-alive connection before the first byte, it is
    retried (up to ``retries`` times) on a fresh connection."""
    for attempt in range(retries + 1):
        res = await _stream_once(session, url, model, prompt, output_len, headers, fresh=attempt > 0)
        if res.ok or not res.dropped_early:
            break
    res.retries = attempt
    return res


async def _stream_once(session, url, model, prompt, output_len, headers, fresh: bool) -> Result:
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
    chunks = 0
    fresh_session = aiohttp.ClientSession(timeout=session.timeout) if fresh else None
    try:
        async with (fresh_session or session).post(url, json=body, headers=headers) as r:
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
                    chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks  # a server without stream usage: one token a chunk
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except _DROPPED as e:
        res.error = f"{type(e).__name__}: {e}"
        res.dropped_early = last is None
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if fresh_session is not None:
            await fresh_session.close()
    return res


async def run_level(base_url, model, prompts, output_len, concurrency, request_rate, seed, headers) -> dict:
    args = (base_url, model, prompts, output_len, concurrency, request_rate, seed, headers)
    return summarize(*await run_level_raw(*args), concurrency, request_rate)


async def run_level_raw(base_url, model, prompts, output_len, concurrency, request_rate, seed, headers) -> tuple:
    """(per-request results, seconds) of one level: ``prompts`` sent with ``concurrency`` in flight."""
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
    return results, duration


def latency_stats(values: list) -> dict:
    """Mean, p50 and p99 in milliseconds of latencies ``values`` in seconds (all None when empty)."""
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
        "retries": sum(r.retries for r in results),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput_per_s": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "ttft_ms": latency_stats([r.ttft for r in ok]),
        "itl_ms": latency_stats([x for r in ok for x in r.itl]),
        "tpot_ms": latency_stats(tpot),
        "e2e_ms": latency_stats([r.e2e for r in ok]),
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


def _wait_healthy(proc, url: str, log, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{log.read()[-2000:]}")
        try:
            status, _ = asyncio.run(_get(url + "/health", timeout=2.0))
            if status == 200:
                return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit(f"{what} did not become healthy within {timeout:.0f}s (log: {log.name})")


def _launch(cmd: list, what: str, timeout: float, url: str, env=None):
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{what}-", suffix=".log", delete=False)
    print(f"starting: {' '.join(cmd)} (log: {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    _wait_healthy(proc, url, log, timeout, what)
    return proc, log.name


def start_server(extra_args: list, timeout: float, env=None):
    """``python server.py`` on a free port; returns (process, base URL, log path) once /health is 200."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(ROOT / "server.py"), "--port", str(port), *extra_args]
    proc, log = _launch(cmd, "rawpaged-serve", timeout, url, env)
    return proc, url, log


def start_llama_server(binary: str, gguf: Path, parallel: int, ctx_per_slot: int, threads: int, timeout: float):
    """llama.cpp's ``llama-server`` on ``gguf`` with ``parallel`` slots (continuous batching) of
    ``ctx_per_slot`` tokens each; returns (process, base URL, log path) once /health is 200."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel)]
    cmd += ["-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    proc, log = _launch(cmd, "llama-server", timeout, url)
    return proc, url, log


def stop(proc) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench_env() -> dict:
    """The environment for a server under benchmark: OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE removed (this
    host's settings slow current OpenBLAS; a user's machine does not set them)."""
    return {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}


def model_name(base_url: str, args, headers: dict | None = None) -> str:
    """``args.model``, or the first model of the server's ``/v1/models``."""
    return model_card(base_url, headers or {})["id"] if not args.model else args.model


def model_card(base_url: str, headers: dict) -> dict:
    status, text = asyncio.run(_get(base_url + "/v1/models", headers=headers))
    if status != 200:
        raise SystemExit(f"GET /v1/models: HTTP {status}: {text[:200]}")
    return json.loads(text)["data"][0]


def levels_of(args) -> list:
    """``((concurrency, request rate), number of prompts)`` per level of ``args``."""
    if args.request_rate:
        levels = [(args.concurrency[min(i, len(args.concurrency) - 1)], r) for i, r in enumerate(args.request_rate)]
    else:
        levels = [(c, float("inf")) for c in args.concurrency]
    nums = args.num_prompts or [4 * c for c, _ in levels]
    if len(nums) == 1:
        nums = nums * len(levels)
    if len(nums) != len(levels):
        raise SystemExit(f"--num-prompts has {len(nums)} values for {len(levels)} levels")
    return list(zip(levels, nums))


def warm_up(base_url: str, model: str, args, headers: dict | None = None) -> None:
    if not args.no_warmup:
        low, high = args.token_id_range
        warm = make_prompts(1, args.input_len, args.seed + 999, low, high)
        asyncio.run(run_level(base_url, model, warm, min(args.output_len, 4), 1, float("inf"), 0, headers or {}))


def run_levels(base_url: str, args, headers: dict, model: str | None = None) -> tuple:
    """(model name, model card, one summary per level) of the levels in ``args`` against ``base_url``."""
    card = model_card(base_url, headers)
    model = model or args.model or card["id"]
    warm_up(base_url, model, args, headers)
    low, high = args.token_id_range
    runs = []
    for i, ((conc, rate), num) in enumerate(levels_of(args)):
        prompts = make_prompts(num, args.input_len, args.seed + i, low, high)
        print(f"running concurrency={conc} rate={rate:g} num_prompts={num} ...", file=sys.stderr)
        runs.append(asyncio.run(run_level(base_url, model, prompts, args.output_len, conc, rate, args.seed, headers)))
    return model, card, runs


def compare_rows(ours: list, theirs: list) -> list:
    """Side-by-side rows per level; speed ratios > 1 mean rawpaged is faster (per-stream speed = 1 / TPOT)."""
    rows = []
    for a, b in zip(ours, theirs):
        row = {"concurrency": a["concurrency"]}
        for key, ra, rb in (
            ("tpot_p50_ms", a["tpot_ms"]["p50"], b["tpot_ms"]["p50"]),
            ("ttft_p50_ms", a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
            ("itl_p50_ms", a["itl_ms"]["p50"], b["itl_ms"]["p50"]),
            ("itl_p99_ms", a["itl_ms"]["p99"], b["itl_ms"]["p99"]),
        ):
            row[key] = {"rawpaged": ra, "llama_server": rb, "ratio": (rb / ra) if ra and rb else None}
        ta, tb = a["output_throughput_tok_s"], b["output_throughput_tok_s"]
        row["output_tok_s"] = {"rawpaged": ta, "llama_server": tb, "ratio": ta / tb if tb else None}
        row["completed"] = {"rawpaged": a["completed"], "llama_server": b["completed"]}
        row["failed"] = {"rawpaged": a["failed"], "llama_server": b["failed"]}
        rows.append(row)
    return rows


def print_compare(rows: list) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"

    cols = ("tpot_p50_ms", "output_tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")
    head = f"{'conc':>5} " + " ".join(f"{c + ' ours/llama (x)':>30}" for c in cols) + f" {'failed':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{f(r[c]['rawpaged'])}/{f(r[c]['llama_server'])} ({f(r[c]['ratio'])}x)" for c in cols]
        failed = f"{r['failed']['rawpaged']}/{r['failed']['llama_server']}"
        lines.append(f"{r['concurrency']:>5} " + " ".join(f"{c:>30}" for c in cells) + f" {failed:>9}")
    lines.append("ratio: > 1 means rawpaged is better (time ratios are llama-server / rawpaged)")
    text = "\n".join(lines)
    print(text)
    return text


def compare_server_args(server_args: str, model: str, max_num_seqs: int) -> list:
    """Our server's arguments in a comparison: ``server_args`` (one string) first, then the model, the
    CPU and ``--max-num-seqs``, which win over anything ``server_args`` says for them."""
    return shlex.split(server_args) + ["--model", model, "--device", "cpu", "--max-num-seqs", str(max_num_seqs)]


def compare_with_llama_server(args) -> int:
    """:func:`compare_servers`, its JSON written to ``args.out``; 0 when no request failed."""
    out = compare_servers(args)
    if args.out:
        from benchmarks.common import write_json

        write_json(args.out, out)
    failed = sum(r["failed"] for name in ("rawpaged", "llama_server") for r in out[name]["runs"])
    return 0 if failed == 0 else 1


def compare_servers(args) -> dict:
    """Both servers on the same weights, the same client and levels. Both are started first; each level
    then runs ``--compare-rounds`` times on each, alternating which goes first (ABBA), and a server's row
    pools its requests over the rounds, so drift in the host's speed falls on both. Returns the results
    (``comparison``: ``compare_rows``' rows) with the run's conditions."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import conditions
    from rawpaged import weights as rp_weights

    if args.compare_gguf:
        gguf = Path(args.compare_gguf)
        ours_model = str(gguf)
    elif args.compare_format == "f32":
        gguf, ours_model = rp_weights.default_f32_gguf_path(), str(rp_weights.prepare(progress=True))
    else:
        gguf = rp_weights.default_gguf_path()
        ours_model = str(gguf)
    parallel = max(args.concurrency)
    env = bench_env()
    ours_args = compare_server_args(args.server_args or "", ours_model, max(64, parallel))
    names = ("rawpaged", "llama_server")
    procs, urls, logs = {}, {}, {}
    try:
        procs["rawpaged"], urls["rawpaged"], logs["rawpaged"] = start_server(ours_args, timeout=600, env=env)
        procs["llama_server"], urls["llama_server"], logs["llama_server"] = start_llama_server(
            args.compare_llama_server, gguf, parallel, 1024, 2, timeout=600
        )
        runs = {name: [] for name in names}
        models = {name: model_name(urls[name], args) for name in names}
        for name in names:
            warm_up(urls[name], models[name], args)
        for i, ((conc, rate), num) in enumerate(levels_of(args)):
            pooled = {name: ([], 0.0) for name in names}
            for r in range(args.compare_rounds):
                # new prompts each round (the same for both servers): a repeated prompt would hit both
                # servers' prompt caches
                prompts = make_prompts(num, args.input_len, args.seed + i + 1000 * r, *args.token_id_range)
                for name in names if r % 2 == 0 else names[::-1]:
                    print(f"{name}: concurrency={conc} num_prompts={num} round {r + 1} ...", file=sys.stderr)
                    res, dur = asyncio.run(
                        run_level_raw(urls[name], models[name], prompts, args.output_len, conc, rate, args.seed, {})
                    )
                    pooled[name] = (pooled[name][0] + list(res), pooled[name][1] + dur)
            for name in names:
                runs[name].append(summarize(*pooled[name], conc, rate))
    finally:
        for proc in procs.values():
            stop(proc)
    results = {}
    for name in names:
        print(f"{name}:", file=sys.stderr)
        results[name] = {"runs": runs[name], "table": print_table(runs[name]), "log": logs[name]}
    rows = compare_rows(results["rawpaged"]["runs"], results["llama_server"]["runs"])
    table = print_compare(rows)
    out = {
        "benchmark": "serve --compare-llama-server",
        "conditions": conditions(
            weights=Path(args.compare_gguf).name if args.compare_gguf else args.compare_format,
            gguf=str(gguf),
            rawpaged_model=ours_model,
            rawpaged_args=ours_args,
            llama_server=f"{args.compare_llama_server} -np {parallel} -c {parallel * 1024} -t 2 -tb 2",
            input_len=args.input_len,
            output_len=args.output_len,
            rounds=f"{args.compare_rounds} per level and server, alternating which server goes first, pooled",
            endpoint="/v1/completions (stream, token-id prompts, ignore_eos, temperature 0)",
            env_unset=["OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"],
        ),
        **results,
        "comparison": rows,
        "table": table,
    }
    return out


def main_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark")
    p.add_argument(
        "--start-server",
        action="store_true",
        help="start `python server.py` on a free port for the run (ignores --base-url)",
    )
    p.add_argument(
        "--server-args",
        default=None,
        help="extra arguments for the started server, one string (default: --device auto; with "
        "--compare-llama-server: none, and what is given goes before the comparison's --model/--device "
        "cpu/--max-num-seqs, which win)",
    )
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
    p.add_argument(
        "--compare-llama-server",
        metavar="PATH",
        default=None,
        help="a llama-server binary: serve the default model's weights with both servers, each level "
        "alternating between them, and print them side by side (see docs/benchmarks.md for building it)",
    )
    p.add_argument(
        "--compare-rounds",
        type=int,
        default=2,
        help="with --compare-llama-server: runs of each level per server, alternating which goes first",
    )
    p.add_argument(
        "--compare-format",
        choices=["f32", "q4_1"],
        default="f32",
        help="weights for --compare-llama-server: the float32 model (llama-server gets an F32 GGUF of it) "
        "or the Q4_1 GGUF file (both servers)",
    )
    p.add_argument(
        "--compare-gguf",
        help="with --compare-llama-server: this GGUF file for both servers (e.g. the Q4_K_M file that "
        "scripts/q4_k_m_check.py makes), in place of --compare-format",
    )
    return p


def main(argv=None) -> int:
    p = main_parser()
    args = p.parse_args(argv)
    if args.compare_gguf and not Path(args.compare_gguf).is_file():
        p.error(f"--compare-gguf {args.compare_gguf}: no such file")
    if args.compare_rounds < 1:
        p.error(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    if args.compare_llama_server:
        return compare_with_llama_server(args)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = None
    server_log = None
    if args.start_server:
        args.server_args = args.server_args or "--device auto"
        extra = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
        proc, base_url, server_log = start_server(extra, timeout=600)
    else:
        base_url = args.base_url
    try:
        model, card, runs = run_levels(base_url, args, headers)
        table = print_table(runs)
    finally:
        stop(proc)
    low, high = args.token_id_range
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
