"""Soak and chaos run against a live ``python server.py`` (started here, so that its fds, RSS and
shutdown can be read): for ``--duration`` seconds a mix of innocent and hostile clients, then SIGTERM.

Innocent clients: streamed and plain chats, websocket streams (half of them cancelled after the first
delta), clients that disconnect mid-stream, n=4 and beam requests, structured (``json_object``) and
tool requests, and greedy requests whose text is compared with the text the same prompt got before
the run. Hostile clients: fuzzed fields, lone surrogates, oversize bodies, bad JSON, unknown models,
and ``--idle-sockets`` connections that are idle or send half a header; each one the server closes
is opened again, so the connection limit stays reached.

Reports requests by outcome, the 5xx count, ``/health`` latency (p50/p99, ms), the innocent greedy
texts that changed, KV blocks, fds and RSS at the start, after warm-up and at the end, and the
shutdown outcome (exit code, the drain line of the log). Prints a table, writes JSON (``--out``), and
exits 1 when a goal that does not depend on the machine is missed (a 5xx, a changed text, a leaked
block, an fd not given back, an unclean shutdown). Example (the conditions go into the JSON):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/soak.py --duration 600 --idle-sockets 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import conditions, write_json  # noqa: E402
from benchmarks.serve import latency_stats, start_server  # noqa: E402

GREEDY = [f"Count from {i} to {i + 5}:" for i in range(4)]
_JSON = {"Content-Type": "application/json"}
#: how long one client call may take before it counts as a hang (seconds)
CALL_TIMEOUT_S = 120


def usage(pid: int) -> dict:
    """Open fds and resident memory of process ``pid`` (Linux ``/proc``)."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS"))
    return {"fds": fds, "rss_mib": round(rss / 1024, 1)}


def shutdown(proc, log_path: str, timeout: float = 60) -> dict:
    """SIGTERM, then the exit code, the seconds it took and the server's drain line."""
    if proc.poll() is not None:
        return {"exit_code": proc.returncode, "seconds": 0.0, "drain": None}
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed"
    drained = re.findall(r"drained: .*", Path(log_path).read_text(errors="replace"))
    return {"exit_code": code, "seconds": round(time.monotonic() - t, 2), "drain": drained[-1] if drained else None}


async def snapshot(url: str, pid: int) -> dict:
    """KV blocks and process usage, read over a connection that is closed after the answer."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.get(url + "/v1/debug/stats") as r:
            st = await r.json()
    await asyncio.sleep(0.3)  # the server closes its side
    keys = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting")
    return {"blocks": {k: st.get(k) for k in keys}, **usage(pid)}


async def greedy_text(s, url, prompt) -> tuple:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        data = await r.json()
        return r.status, data["choices"][0]["message"]["content"] if r.status == 200 else data


class Soak:
    def __init__(self, url: str, until: float, rng: random.Random, reference: dict):
        self.url, self.until, self.rng, self.reference = url, until, rng, reference
        self.outcomes = Counter()
        self.health_s: list = []
        self.changed: list = []
        self.reopened = 0

    def record(self, kind: str, status) -> None:
        self.outcomes[f"{kind} {status}"] += 1

    async def guarded(self, kind: str, coro) -> None:
        """Run one client call; a transport error or a hang is an outcome, never the end of the run."""
        try:
            await asyncio.wait_for(coro, CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.record(kind, "hang")
        except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as e:
            self.record(kind, type(e).__name__)

    async def post(self, s, kind, path, body=None, data=None, headers=None):
        async with s.post(self.url + path, json=body, data=data, headers=headers) as r:
            await r.read()
            self.record(kind, r.status)

    async def greedy(self, s):
        prompt = self.rng.choice(GREEDY)
        status, text = await greedy_text(s, self.url, prompt)
        self.record("greedy", status)
        if status == 200 and text != self.reference[prompt]:
            self.changed.append({"prompt": prompt, "text": text, "before": self.reference[prompt]})

    async def innocent(self, s):
        chat = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 32}
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        calls = [
            ("greedy", lambda: self.greedy(s)),
            ("stream", lambda: self.post(s, "stream", "/v1/chat/completions", {**chat, "stream": True})),
            ("n=4", lambda: self.post(s, "n=4", "/v1/chat/completions", {**chat, "n": 4})),
            (
                "beam",
                lambda: self.post(
                    s,
                    "beam",
                    "/v1/completions",
                    {"prompt": "The sea", "use_beam_search": True, "n": 2, "max_tokens": 16},
                ),
            ),
            (
                "json",
                lambda: self.post(
                    s, "json", "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}
                ),
            ),
            (
                "tools",
                lambda: self.post(
                    s, "tools", "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}
                ),
            ),
            ("disconnect", lambda: self.disconnect(s)),
            ("ws", lambda: self.websocket(s)),
        ]
        while time.monotonic() < self.until:
            kind, call = self.rng.choice(calls)
            await self.guarded(kind, call())

    async def disconnect(self, s):
        body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with s.post(self.url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                break
            self.record("disconnect", r.status)
            r.close()  # drops the connection mid-stream

    async def websocket(self, s):
        cancel = self.rng.random() < 0.5
        async with s.ws_connect(self.url + "/v1/ws") as ws:
            await ws.send_str(json.dumps({"type": "generate", "id": 1, "prompt": "Hi", "max_tokens": 64}))
            while True:
                frame = await ws.receive(timeout=CALL_TIMEOUT_S)
                if frame.type != aiohttp.WSMsgType.TEXT:
                    self.record("ws", f"closed {frame.type.name}")
                    return
                msg = json.loads(frame.data)
                if cancel and msg["type"] == "delta":
                    await ws.send_str(json.dumps({"type": "cancel", "id": 1}))
                    cancel = False
                if msg["type"] in ("done", "error"):
                    kind = "ws-cancel" if msg.get("finish_reason") == "abort" else "ws"
                    self.record(kind, msg.get("status", 200) if msg["type"] == "error" else 200)
                    return

    async def hostile(self, s):
        big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
        fields = ["max_tokens", "temperature", "n", "stop", "logprobs", "seed", "top_p", "messages", "tools"]
        values = [-1, 1e308, "x", None, [], {}, 10**30, True, [{"role": "nobody"}], "\ud800"]
        while time.monotonic() < self.until:
            pick = self.rng.randrange(5)
            if pick == 0:
                call = self.post(s, "bad-json", "/v1/completions", data=b'{"prompt": ', headers=_JSON)
            elif pick == 1:
                call = self.post(s, "surrogate", "/v1/completions", data=b'{"prompt": "a \\ud800"}', headers=_JSON)
            elif pick == 2:
                call = self.post(s, "oversize", "/v1/completions", data=big, headers=_JSON)
            elif pick == 3:
                path = self.rng.choice(["/v1/completions", "/v1/chat/completions"])
                body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                field, value = self.rng.choice(fields), self.rng.choice(values)
                if not (field == "max_tokens" and value is None):  # no limit: a long innocent chat
                    body[field] = value
                data = json.dumps(body).encode("utf-8", "surrogatepass")
                call = self.post(s, "fuzz", path, data=data, headers=_JSON)
            else:
                call = self.post(s, "bad-model", "/v1/completions", {"prompt": "hi", "model": "nope"})
            await self.guarded(["bad-json", "surrogate", "oversize", "fuzz", "bad-model"][pick], call)

    async def idle_socket(self, port: int, slow: bool):
        """One connection that never finishes a request; opened again whenever the server closes it."""
        while time.monotonic() < self.until:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                self.record("idle-socket", "refused")
                await asyncio.sleep(1)
                continue
            try:
                if slow:
                    writer.write(b"GET /health HTTP/1.1\r\nHost: loc")
                remaining = self.until - time.monotonic()
                await asyncio.wait_for(reader.read(), max(remaining, 0.01))
                self.reopened += 1
            except (asyncio.TimeoutError, ConnectionError):
                pass
            finally:
                writer.close()

    async def health(self, s):
        timeout = aiohttp.ClientTimeout(total=10)
        while time.monotonic() < self.until:
            t = time.perf_counter()
            try:
                async with s.get(self.url + "/health", timeout=timeout) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            self.health_s.append(time.perf_counter() - t)
            self.record("health", status)
            await asyncio.sleep(0.1)


async def run(args) -> dict:
    server_args = ["--max-connections", str(args.max_connections), "--shutdown-timeout", "5"]
    server_args += [*(["--model", args.model] if args.model else []), *args.server_args]
    proc, url, log_path = await asyncio.to_thread(start_server, server_args, 900)  # it runs its own loop
    try:
        port = int(url.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as s:
            reference = {}
            for p in GREEDY:
                status, reference[p] = await greedy_text(s, url, p)
                if status != 200:
                    raise SystemExit(f"reference request failed: {status} {reference[p]}")
        start = await snapshot(url, proc.pid)
        soak = Soak(url, time.monotonic() + args.duration, random.Random(args.seed), reference)
        marks = {}

        async def warm_mark():
            await asyncio.sleep(args.duration * 0.25)
            marks["warm"] = usage(proc.pid)

        # the health and hostile clients use their own sessions, so innocent ones never queue them
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as innocent,
            aiohttp.ClientSession() as hostile,
            aiohttp.ClientSession() as health,
        ):
            tasks = [soak.innocent(innocent) for _ in range(args.concurrency)]
            tasks += [soak.hostile(hostile) for _ in range(2)] + [soak.health(health), warm_mark()]
            tasks += [soak.idle_socket(port, slow=bool(i % 2)) for i in range(args.idle_sockets)]
            await asyncio.gather(*tasks)
        await asyncio.sleep(1)
        end = await snapshot(url, proc.pid)
    finally:
        stopped = shutdown(proc, log_path)
    outcomes = soak.outcomes
    return {
        "conditions": conditions(
            duration_s=args.duration,
            innocent_clients=args.concurrency,
            idle_sockets=args.idle_sockets,
            max_connections=args.max_connections,
            model=args.model or "default",
            server_args=args.server_args,
            seed=args.seed,
        ),
        "outcomes": dict(sorted(outcomes.items())),
        "num_requests": sum(outcomes.values()),
        "num_5xx": sum(n for k, n in outcomes.items() if k.split()[-1].startswith("5")),
        "num_hangs": sum(n for k, n in outcomes.items() if k.endswith(" hang")),
        "idle_sockets_reopened": soak.reopened,
        "health_ms": {"n": len(soak.health_s), **latency_stats(soak.health_s)},
        "changed_innocent_outputs": soak.changed,
        "start": start,
        "warm": marks.get("warm"),
        "end": end,
        "blocks_leaked": end["blocks"]["num_total_blocks"] - end["blocks"]["num_free_blocks"],
        "fds_not_returned": end["fds"] - start["fds"],
        "rss_growth_after_warmup": round(end["rss_mib"] / marks["warm"]["rss_mib"] - 1, 4) if "warm" in marks else None,
        "shutdown": stopped,
    }


def goals_met(result: dict) -> bool:
    """The goals that hold on any machine (the RSS and /health latency goals are read from the table)."""
    return (
        result["num_5xx"] == 0
        and result["num_hangs"] == 0
        and not result["changed_innocent_outputs"]
        and result["blocks_leaked"] == 0
        and result["fds_not_returned"] <= 0
        and result["shutdown"]["exit_code"] == 0
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8, help="innocent clients")
    p.add_argument("--idle-sockets", type=int, default=1000)
    p.add_argument("--max-connections", type=int, default=1100, help="the server's --max-connections")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out/soak.json")
    p.add_argument("server_args", nargs="*", help="more server options (after --)")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(f"{'outcome':<32}{'count':>8}")
    for k, n in result["outcomes"].items():
        print(f"{k:<32}{n:>8}")
    rows = {
        "5xx": result["num_5xx"],
        "hangs": result["num_hangs"],
        "changed innocent outputs": len(result["changed_innocent_outputs"]),
        "blocks leaked": result["blocks_leaked"],
        "fds start / end": f"{result['start']['fds']} / {result['end']['fds']}",
        "RSS MiB start / warm / end": " / ".join(
            str((result[k] or {}).get("rss_mib")) for k in ("start", "warm", "end")
        ),
        "RSS growth after warm-up": result["rss_growth_after_warmup"],
        "/health p50 / p99 ms": "{p50:.2f} / {p99:.2f}".format(**result["health_ms"]),
        "idle sockets reopened": result["idle_sockets_reopened"],
        "shutdown": json.dumps(result["shutdown"]),
    }
    for k, v in rows.items():
        print(f"{k:<32}{v!s:>8}")
    write_json(args.out, result)
    return 0 if goals_met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
