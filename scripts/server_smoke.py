"""Server smoke check: ``python server.py`` on a random model, driven as clients drive it, every block back.

Writes a randomly initialised model (``rawpaged.testing.random_model``; ``--shape default`` is the default model's
shape: 30 layers, hidden 576, 9/3 heads, vocab 49152; ``tiny`` is a 2-layer one), starts the server on it
with ``--device``, then sends, in order: a streamed chat completion (SSE), a websocket ``generate``, an
``n=4`` completion, a ``json_object`` chat completion (structured output), 16 concurrent completions, and
reads ``/metrics``: no request running and every KV block free. Each check's result (ok, seconds, what
came back) is written to ``--out``/``server_smoke.json`` as soon as it is known, with the server's log
beside it in ``server.log``.

Usage: ``python scripts/server_smoke.py --device cuda --out DIR [--shape default|tiny]`` (exit code 1 if a
check fails). Needs aiohttp only on the client side; the server needs what it always needs (pydantic,
llguidance for the structured request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from rawpaged.testing.random_model import SHAPES as RANDOM_SHAPES
from rawpaged.testing.random_model import write_random_model

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"default": RANDOM_SHAPES["smollm2-135m-shape"], "tiny": RANDOM_SHAPES["small"]}
MAX_TOKENS = 16
CONCURRENT = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_healthy(session, base, proc, timeout_s) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"/health not 200 within {timeout_s:.0f} s")


async def streamed_chat(session, base) -> dict:
    body = {
        "model": "smoke",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    chunks, done, finish, usage = 0, False, None, None
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "status": r.status, "body": await r.text()}
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            chunks += 1
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                finish = c.get("finish_reason") or finish
    ok = done and finish in ("length", "stop") and usage is not None and 1 <= usage["completion_tokens"] <= MAX_TOKENS
    return {"ok": ok, "chunks": chunks, "finish_reason": finish, "usage": usage, "done": done}


async def websocket_generate(session, base) -> dict:
    deltas, final = 0, None
    async with session.ws_connect(f"{base}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "w1", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS})
        async for msg in ws:
            event = json.loads(msg.data)
            if event.get("type") == "delta":
                deltas += 1
            elif event.get("type") in ("done", "error"):
                final = event
                break
    ok = final is not None and final.get("type") == "done" and final.get("finish_reason") in ("length", "stop")
    return {"ok": ok and deltas >= 1, "deltas": deltas, "final": final}


async def completion(session, base, **params) -> dict:
    body = {"model": "smoke", "prompt": "The best way to learn is", "max_tokens": MAX_TOKENS, **params}
    async with session.post(f"{base}/v1/completions", json=body) as r:
        data = await r.json(content_type=None)
        return {"status": r.status, **data}


async def parallel_sampling(session, base) -> dict:
    r = await completion(session, base, n=4, temperature=0.8, seed=1)
    choices = r.get("choices", [])
    ok = r["status"] == 200 and sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    return {"ok": ok, "status": r["status"], "finish_reasons": [c.get("finish_reason") for c in choices]}


async def structured_chat(session, base) -> dict:
    body = {
        "model": "smoke",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 48,
        "response_format": {"type": "json_object"},
        "temperature": 0,
    }
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        data = await r.json(content_type=None)
    if r.status != 200:
        return {"ok": False, "status": r.status, "body": data}
    choice = data["choices"][0]
    text = choice["message"]["content"]
    try:
        parsed = isinstance(json.loads(text), dict)
    except ValueError:
        parsed = False
    # a random model may run out of tokens inside the object; a finished one must parse
    ok = parsed if choice["finish_reason"] == "stop" else choice["finish_reason"] == "length"
    return {"ok": ok, "finish_reason": choice["finish_reason"], "text": text[:200]}


async def concurrent_completions(session, base) -> dict:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(completion(session, base, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in range(CONCURRENT))
    )
    seconds = time.perf_counter() - t0
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) for r in results)
    ok = all(r["status"] == 200 for r in results) and tokens == CONCURRENT * MAX_TOKENS
    statuses = sorted({r["status"] for r in results})
    return {"ok": ok, "statuses": statuses, "tokens": tokens, "tok_per_s": tokens / seconds}


async def blocks_back(session, base) -> dict:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()

    def gauge(name):
        m = re.search(rf"^rawpaged:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else None

    values = {k: gauge(k) for k in ("num_requests_running", "num_free_blocks", "num_total_blocks", "num_used_blocks")}
    ok = (
        values["num_total_blocks"] is not None
        and values["num_free_blocks"] == values["num_total_blocks"]
        and values["num_used_blocks"] == 0
        and values["num_requests_running"] == 0
    )
    return {"ok": ok, **values}


CHECKS = [streamed_chat, websocket_generate, parallel_sampling, structured_chat, concurrent_completions, blocks_back]


async def _drive(base, proc, results, write, startup_timeout_s, check_timeout_s) -> None:
    timeout = aiohttp.ClientTimeout(total=check_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await _wait_healthy(session, base, proc, startup_timeout_s)
        results["startup_s"] = time.perf_counter() - t0
        write()
        for check in CHECKS:
            t0 = time.perf_counter()
            try:
                r = await check(session, base)
            except Exception as e:  # report every check, then fail
                r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            r["seconds"] = time.perf_counter() - t0
            results["checks"][check.__name__] = r
            print(f"{check.__name__}: ok={r['ok']} ({r['seconds']:.1f} s)", flush=True)
            write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--startup-timeout", type=float, default=240.0, help="seconds for /health to answer 200")
    ap.add_argument("--check-timeout", type=float, default=120.0, help="seconds for each check")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": args.device, "shape": args.shape, "ok": False, "checks": {}}

    def write():
        (out / "server_smoke.json").write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_model(Path(tmp) / f"random-{args.shape}", seed=0, **SHAPES[args.shape])
        port = _free_port()
        cmd = [sys.executable, str(ROOT / "server.py"), "--model", str(model), "--device", args.device]
        cmd += ["--port", str(port), "--served-model-name", "smoke", "--num-kv-blocks", str(args.num_kv_blocks)]
        results["command"] = " ".join(cmd[1:])
        write()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(out / "server.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                asyncio.run(
                    _drive(f"http://127.0.0.1:{port}", proc, results, write, args.startup_timeout, args.check_timeout)
                )
            except Exception as e:
                results["error"] = f"{type(e).__name__}: {e}"
                print(f"server smoke: {results['error']}", flush=True)
            finally:
                proc.terminate()
                try:
                    results["server_exit_code"] = proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    results["server_exit_code"] = proc.wait()
    checks = results["checks"]
    results["ok"] = len(checks) == len(CHECKS) and all(c["ok"] for c in checks.values()) and "error" not in results
    results["clean_exit"] = results["server_exit_code"] == 0
    write()
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
