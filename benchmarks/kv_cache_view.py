"""What the KV cache view costs: one snapshot at 64 running requests, and the server's step loop with
one websocket subscriber attached against none, in alternating runs.

Part 1 (in process, the default model on the CPU): 64 requests decoding, then per snapshot the time
``capture`` holds the engine thread (between two steps), ``to_json`` and ``json.dumps`` (on the event
loop's thread), the snapshot's size, and a delta's size and time after one subscriber interval.

Part 2 (``python server.py`` in a subprocess): 64 concurrent websocket requests (``--input-len`` prompt
tokens, ``--output-len`` generated, ``ignore_eos``) per run, runs alternating without and with one
``subscribe_kv_cache`` subscriber (``--interval-ms``, the playground's 200 ms) on another socket; the
engine's output tok/s and mean step time from ``/v1/debug/stats``.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/kv_cache_view.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import conditions, print_table, write_json  # noqa: E402
from benchmarks.serve import bench_env, make_prompts, start_server, stop  # noqa: E402


def snapshot_cost(args) -> dict:
    from rawpaged.config import EngineConfig
    from rawpaged.core.kv_cache_snapshot import KVCacheSnapshotDiffer, to_json
    from rawpaged.engine.llm_engine import LLMEngine
    from rawpaged.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", max_num_seqs=args.num_requests))
    engine.warmup()
    params = SamplingParams(max_tokens=100_000 // args.num_requests, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(make_prompts(args.num_requests, args.input_len, 1, 10, 40_000)):
        engine.add_request({"prompt_token_ids": p}, params, f"r{i}")
    sched = engine.scheduler
    while len(sched.running) < args.num_requests or any(s.is_prefill for s in sched.running):
        engine.step()
    steps, captures, jsons, dumps, sizes, deltas, delta_sizes = [], [], [], [], [], [], []
    differ = KVCacheSnapshotDiffer()
    differ.update(to_json(engine.kv_cache_state()))
    for _ in range(args.samples):
        for _ in range(args.steps_per_interval):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = engine.kv_cache_state()
        t1 = time.perf_counter()
        snap = to_json(state)
        t2 = time.perf_counter()
        text = json.dumps(snap)
        t3 = time.perf_counter()
        _, delta = differ.update(snap)
        delta_text = json.dumps(delta)
        t4 = time.perf_counter()
        captures.append(t1 - t0)
        jsons.append(t2 - t1)
        dumps.append(t3 - t2)
        deltas.append(t4 - t3)
        sizes.append(len(text))
        delta_sizes.append(len(delta_text))
    med = statistics.median
    used = engine.kv_cache_manager.block_pool.num_used_blocks
    return {
        "num_requests": args.num_requests,
        "num_blocks": engine.kv_cache_manager.num_blocks,
        "used_blocks": used,
        "step_ms": med(steps) * 1e3,
        "capture_ms": med(captures) * 1e3,
        "to_json_ms": med(jsons) * 1e3,
        "dumps_ms": med(dumps) * 1e3,
        "delta_ms": med(deltas) * 1e3,
        "snapshot_kb": med(sizes) / 1024,
        "delta_kb": med(delta_sizes) / 1024,
        "steps_per_interval": args.steps_per_interval,
        "engine_thread_share_at_5hz": 5 * med(captures),
    }


async def _stats(session, url) -> dict:
    async with session.get(url + "/v1/debug/stats") as r:
        return await r.json()


async def _subscriber(url, interval_ms, stop_event, counts) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/ws", max_msg_size=64 << 20) as ws:
        await ws.send_json({"type": "subscribe_kv_cache", "id": "kv", "interval_ms": interval_ms})
        while not stop_event.is_set():
            try:
                msg = await ws.receive(timeout=0.5)
            except asyncio.TimeoutError:
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            json.loads(msg.data)
            counts["messages"] += 1
            counts["bytes"] += len(msg.data)


async def one_run(url, prompts, output_len, subscribe: bool, interval_ms: int) -> dict:
    counts = {"messages": 0, "bytes": 0}
    stop_event = asyncio.Event()
    async with aiohttp.ClientSession() as s:
        watcher = asyncio.create_task(_subscriber(url, interval_ms, stop_event, counts)) if subscribe else None
        if watcher is not None:
            await asyncio.sleep(0.5)  # the first snapshot is out of the way
        before = await _stats(s, url)
        t0 = time.perf_counter()
        async with s.ws_connect(url + "/v1/ws") as ws:
            for i, p in enumerate(prompts):
                await ws.send_json(
                    {"type": "generate", "id": i, "prompt": p, "max_tokens": output_len, "ignore_eos": True}
                )
            done = 0
            while done < len(prompts):
                msg = await ws.receive_json(timeout=300)
                assert msg["type"] in ("delta", "done"), msg
                done += msg["type"] == "done"
        wall = time.perf_counter() - t0
        after = await _stats(s, url)
        stop_event.set()
        if watcher is not None:
            await watcher
    steps = after["num_steps"] - before["num_steps"]
    tokens = after["generation_tokens_total"] - before["generation_tokens_total"]
    return {
        "subscriber": subscribe,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "steps": steps,
        "step_ms": wall / max(1, steps) * 1e3,
        "kv_messages": counts["messages"],
        "kv_kb": counts["bytes"] / 1024,
    }


def step_loop_overhead(args) -> tuple:
    extra = ["--device", "cpu", "--max-num-seqs", str(args.num_requests)]
    if args.model:
        extra += ["--model", args.model]
    proc, url, log = start_server(extra, timeout=600, env=bench_env())
    try:
        prompts = make_prompts(args.num_requests, args.input_len, 2, 10, 40_000)
        asyncio.run(one_run(url, prompts, args.output_len, False, args.interval_ms))  # warm-up, discarded
        runs = []
        for i in range(args.pairs):
            for subscribe in (False, True) if i % 2 == 0 else (True, False):
                runs.append(asyncio.run(one_run(url, prompts, args.output_len, subscribe, args.interval_ms)))
                print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        stop(proc)
    off = [r["output_tok_s"] for r in runs if not r["subscriber"]]
    on = [r["output_tok_s"] for r in runs if r["subscriber"]]
    return runs, statistics.median(on) / statistics.median(off)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or GGUF (default: the default model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--samples", type=int, default=20, help="snapshots measured in part 1")
    p.add_argument("--steps-per-interval", type=int, default=4, help="part 1: steps between two snapshots")
    p.add_argument("--interval-ms", type=int, default=200, help="part 2: the subscriber's interval")
    p.add_argument("--pairs", type=int, default=3, help="part 2: runs without and with a subscriber, alternating")
    p.add_argument("--skip-server", action="store_true", help="part 1 only")
    p.add_argument("--out", default="benchmarks/out/kv_cache_view.json")
    args = p.parse_args(argv)

    cost = snapshot_cost(args)
    cols = ["num_requests", "num_blocks", "used_blocks", "step_ms", "capture_ms", "to_json_ms", "dumps_ms"]
    print_table([cost], cols + ["delta_ms", "snapshot_kb", "delta_kb"])
    result = {"conditions": conditions(model=args.model or "default"), "snapshot": cost}
    if not args.skip_server:
        runs, ratio = step_loop_overhead(args)
        print_table(runs, ["subscriber", "wall_s", "output_tok_s", "steps", "step_ms", "kv_messages", "kv_kb"])
        print(f"output tok/s with a subscriber / without (medians of {args.pairs}): {ratio:.3f}")
        result.update(runs=runs, ratio_with_subscriber=ratio)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
