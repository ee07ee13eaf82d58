"""CUDA kernel microbenchmark: decode ``paged_attention`` effective bandwidth against the device's copy
bandwidth, paged (blocks scattered by a random permutation) vs contiguous (the same kernel with an identity
block table over a contiguous pool, so the difference is the cost of paging alone).

Grid: batch 1/8/32 x context 128/1024/4096 x {head_dim 64 with 9 query / 3 KV heads, head_dim 128 with
32 / 8} x {bf16, fp32} (activations and cache of one dtype), block_size 16. Effective bandwidth = bytes of
K and V the kernel must read (batch * context * kv_heads * head_dim * 2 * itemsize) / time; the copy
bandwidth counts bytes read + written by a device-to-device cudaMemcpy, the usual "achievable" figure.
Kernel times are replays of a CUDA graph of 20 calls (device time, without Python dispatch and launch
latency); "eager us" is one call as an eager step makes it.

Second table: token sampling for a batch of bf16 logits rows (vocab 49152, the default model's): the device
``sample_kernel`` (only ids come back) against copying the rows to the host and sampling there with the
CPU reference (``rawpaged.testing.reference_sampler.sample``), for greedy and for temperature + top-k + top-p rows.

Usage (on a CUDA host, from the source tree):
    PYTHONPATH=. python benchmarks/kernels_cuda.py --out DIR [--quick]
Writes DIR/kernels_cuda.json and DIR/kernels_cuda.txt; prints the table last.
``--dry-run`` runs the same code on the CPU emulation of the kernels (tiny shapes, meaningless timings),
to check the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from rawpaged.kernels.cuda import launch_config

HEAD_CONFIGS = ((64, 9, 3), (128, 32, 8))  # (head_dim, query heads, kv heads)
DTYPES = (("bf16", np.uint16), ("fp32", np.float32))
BATCHES = (1, 8, 32)
CONTEXTS = (128, 1024, 4096)
BLOCK_SIZE = 16


class Timer:
    """Device time of a callable: CUDA events on a GPU, wall clock otherwise."""

    def __init__(self, xp):
        self.cuda = hasattr(xp, "cuda")
        self.xp = xp

    def sync(self):
        if self.cuda:
            self.xp.cuda.Stream.null.synchronize()

    def __call__(self, fn, min_time=0.05, max_iters=200, warmup=3) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        iters, total = 1, 0.0
        while True:
            if self.cuda:
                start, stop = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                for _ in range(iters):
                    fn()
                stop.record()
                stop.synchronize()
                total = self.xp.cuda.get_elapsed_time(start, stop) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                total = time.perf_counter() - t0
            if total >= min_time or iters >= max_iters:
                return total / iters
            iters = min(max_iters, max(iters * 2, int(iters * min_time / max(total, 1e-9)) + 1))


#: kernel calls recorded in one CUDA graph by ``device_time``
CALLS_PER_GRAPH = 20


def device_time(be, timer, fn) -> float:
    """Seconds per call of the kernels ``fn`` launches. On a GPU, ``CALLS_PER_GRAPH`` calls are captured in
    one CUDA graph and the replays timed, so a small kernel's time is not its Python dispatch and launch
    latency (``fn`` must launch only raw kernels: no cuBLAS, no host synchronization); otherwise ``fn``
    itself is timed."""
    if not getattr(be, "supports_cuda_graphs", False):
        return timer(fn)

    def calls():
        for _ in range(CALLS_PER_GRAPH):
            fn()

    replay, _ = be.capture_graph(calls)
    return timer(replay) / CALLS_PER_GRAPH


def copy_bandwidth(be, timer, nbytes) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written."""
    xp = be.xp
    a = xp.ones(nbytes // 4, dtype=np.float32)
    b = xp.empty_like(a)
    if hasattr(a, "data") and hasattr(a.data, "copy_from_device_async"):
        t = timer(lambda: b.data.copy_from_device_async(a.data, a.nbytes))
    else:
        t = timer(lambda: np.copyto(b, a))
    return 2 * a.nbytes / t / 1e9


def random_cache(xp, shape, dtype, seed):
    x = xp.random.RandomState(seed).standard_normal(shape).astype(np.float32)
    if dtype == np.uint16:  # bf16 bits (truncated; plenty for a benchmark)
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


def bench_case(be, timer, dtype, head_dim, num_heads, num_kv_heads, batch, context):
    xp = be.xp
    bps = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * bps
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kc = random_cache(xp, shape, dtype, 0)
    vc = random_cache(xp, shape, dtype, 1)
    q = random_cache(xp, (batch, num_heads, head_dim), dtype, 2)
    out = xp.empty_like(q)
    ctx = xp.asarray(np.full(batch, context, np.int32))
    perm = np.random.default_rng(0).permutation(num_blocks).astype(np.int32).reshape(batch, bps)
    identity = np.arange(num_blocks, dtype=np.int32).reshape(batch, bps)
    tables = {"paged": xp.asarray(perm), "contiguous": xp.asarray(identity)}
    scale = head_dim**-0.5
    calls = {k: (lambda bt=bt: be.paged_attention(out, q, kc, vc, bt, ctx, scale)) for k, bt in tables.items()}
    times = {k: device_time(be, timer, fn) for k, fn in calls.items()}
    eager = timer(calls["paged"])  # with Python dispatch and launch latency, as an eager step pays them
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * np.dtype(dtype).itemsize
    cfg = launch_config.decode_config(batch, num_heads, num_kv_heads, head_dim, bps * BLOCK_SIZE, be.num_sms)
    return dict(
        dtype="bf16" if dtype == np.uint16 else "fp32",
        head_dim=head_dim,
        heads=num_heads,
        kv_heads=num_kv_heads,
        batch=batch,
        context=context,
        splits=cfg["num_splits"],
        kv_bytes=kv_bytes,
        paged_us=times["paged"] * 1e6,
        paged_eager_us=eager * 1e6,
        contiguous_us=times["contiguous"] * 1e6,
        paged_GBps=kv_bytes / times["paged"] / 1e9,
        contiguous_GBps=kv_bytes / times["contiguous"] / 1e9,
    )


SAMPLE_CASES = (("greedy", (0.0, -1, 1.0, 0.0)), ("T0.8 k50 p0.9", (0.8, 50, 0.9, 0.0)))


def bench_sampling(be, timer, batch, vocab, case):
    from rawpaged.testing import reference_sampler

    xp = be.xp
    logits = random_cache(xp, (batch, vocab), np.uint16, 3)
    t, k, p, m = case
    args = dict(
        sample_rows=np.arange(batch),
        temperature=np.full(batch, t),
        top_k=np.full(batch, k),
        top_p=np.full(batch, p),
        min_p=np.full(batch, m),
        uniforms=np.random.default_rng(0).random(batch),
    )
    device = timer(lambda: be.sample(logits, **args))
    host = timer(lambda: reference_sampler.sample(be.to_numpy(logits).astype(np.float32), **args), max_iters=20)
    return dict(batch=batch, vocab=vocab, device_us=device * 1e6, host_us=host * 1e6)


def make_backend(dry_run: bool):
    if not dry_run:
        from rawpaged.kernels.cuda.backend import CudaBackend

        be = CudaBackend()
        props = be.xp.cuda.runtime.getDeviceProperties(be.device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return be, name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.cuda_emu import Emulator, build, emulated_backend

    return emulated_backend(Emulator(build()), num_sms=8), "CPU emulation (dry run)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for kernels_cuda.json / kernels_cuda.txt")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 32, contexts 128 and 4096 only")
    ap.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    be, device = make_backend(args.dry_run)
    timer = Timer(be.xp)
    batches, contexts = (BATCHES, CONTEXTS)
    if args.quick:
        batches, contexts = (1, 32), (128, 4096)
    if args.dry_run:
        batches, contexts = (1, 2), (20, 40)

    t0 = time.perf_counter()

    def once(fn, **_):
        fn()
        timer.sync()
        return 1.0

    warm = {}
    for name, dtype in DTYPES:  # the first launch compiles the module (NVRTC; CuPy caches it on disk)
        t = time.perf_counter()
        bench_case(be, once, dtype, 128, 32, 8, 1, 16)
        warm[name] = time.perf_counter() - t
    copy_gbps = copy_bandwidth(be, timer, (1 << 30) if not args.dry_run else (1 << 20))
    rows = []
    for _, dtype in DTYPES:
        for head_dim, heads, kv_heads in HEAD_CONFIGS:
            for batch in batches:
                for context in contexts:
                    r = bench_case(be, timer, dtype, head_dim, heads, kv_heads, batch, context)
                    r["paged_frac_of_copy"] = r["paged_GBps"] / copy_gbps
                    rows.append(r)
                    if hasattr(be.xp, "get_default_memory_pool"):
                        be.xp.get_default_memory_pool().free_all_blocks()
    vocab = 49152 if not args.dry_run else 300
    sampling = []
    for label, case in SAMPLE_CASES:
        for batch in (1, 32) if not args.dry_run else (1, 2):
            sampling.append(dict(case=label, **bench_sampling(be, timer, batch, vocab, case)))
    result = dict(
        device=device,
        num_sms=be.num_sms,
        copy_GBps=copy_gbps,
        first_use_compile_s=warm,
        block_size=BLOCK_SIZE,
        host=platform.node(),
        seconds=time.perf_counter() - t0,
        results=rows,
        sampling=sampling,
    )
    (out_dir / "kernels_cuda.json").write_text(json.dumps(result, indent=1))

    lines = [
        f"paged_attention on {device} ({be.num_sms} SMs); device copy {copy_gbps:.0f} GB/s (read+write)",
        f"{'dtype':5} {'D':>3} {'H/Hkv':>6} {'batch':>5} {'ctx':>5} {'splits':>6} {'paged us':>9} "
        f"{'GB/s':>7} {'%copy':>6} {'contig us':>9} {'GB/s':>7} {'eager us':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['dtype']:5} {r['head_dim']:>3} {r['heads']:>3}/{r['kv_heads']:<2} {r['batch']:>5} "
            f"{r['context']:>5} {r['splits']:>6} {r['paged_us']:>9.1f} {r['paged_GBps']:>7.0f} "
            f"{100 * r['paged_frac_of_copy']:>5.0f}% {r['contiguous_us']:>9.1f} {r['contiguous_GBps']:>7.0f} "
            f"{r['paged_eager_us']:>9.1f}"
        )
    lines += [
        "",
        f"sampling bf16 logits, vocab {vocab}: device kernel vs logits to host + CPU reference",
        f"{'case':14} {'batch':>5} {'device us':>10} {'host us':>10} {'host/device':>11}",
    ]
    for r in sampling:
        lines.append(
            f"{r['case']:14} {r['batch']:>5} {r['device_us']:>10.1f} {r['host_us']:>10.1f} "
            f"{r['host_us'] / r['device_us']:>10.1f}x"
        )
    table = "\n".join(lines)
    (out_dir / "kernels_cuda.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
