"""Paged-attention microbenchmark (CPU backend): paged vs contiguous, and effective bandwidth.

For batch x context, decode attention with the default model's shapes (9 query heads, 3 KV heads,
head_dim 64, float32 KV) is timed three ways in one run:
  * rawpaged ``paged_attention`` over blocks scattered randomly through a pool;
  * the same kernel over a pool where each sequence's blocks are consecutive (paging overhead
    without scattering);
  * contiguous NumPy attention: one ``[num_kv_heads, ctx, head_dim]`` K and V array per sequence, BLAS
    matmuls (the non-paged baseline).
Effective bandwidth = KV bytes read (K and V of every context token) / time, beside the machine's
measured copy bandwidth (``np.copyto`` of 512 MiB: bytes read + written / time).

Usage: ``python benchmarks/kernels.py [--batches 1 8 32] [--contexts 128 1024 4096] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import best_time, conditions, print_table, write_json  # noqa: E402
from rawpaged.kernels.cpu import attention as cpu_attention  # noqa: E402


def copy_bandwidth(nbytes: int = 512 << 20) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t = best_time(lambda: np.copyto(dst, src), repeat=5, min_time=0.3)
    return 2 * nbytes / t


def contiguous_attention(q, ks, vs, scale):
    """q [B, H, D]; ks/vs: per sequence [Hkv, ctx, D]. Returns [B, H, D]."""
    B, H, D = q.shape
    out = np.empty_like(q)
    for b in range(B):
        k, v = ks[b], vs[b]
        hkv = k.shape[0]
        qg = q[b].reshape(hkv, H // hkv, D)
        s = np.matmul(qg, k.transpose(0, 2, 1)) * scale  # [Hkv, g, ctx]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[b] = np.matmul(s, v).reshape(H, D)
    return out


def run_case(rng, batch, ctx, num_heads, num_kv_heads, head_dim, block_size):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = rng.standard_normal(shape, dtype=np.float32)
    vc = rng.standard_normal(shape, dtype=np.float32)
    scattered = rng.permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int32)
    consecutive = np.arange(num_blocks, dtype=np.int32).reshape(batch, blocks_per_seq)
    q = rng.standard_normal((batch, num_heads, head_dim), dtype=np.float32)
    lens = np.full(batch, ctx, np.int32)
    out = np.empty_like(q)
    scale = head_dim**-0.5
    # Contiguous per-sequence copies of exactly the same K/V, laid out [Hkv, ctx, D].
    ks = [
        np.ascontiguousarray(kc[scattered[b]].reshape(-1, num_kv_heads, head_dim)[:ctx].transpose(1, 0, 2))
        for b in range(batch)
    ]
    vs = [
        np.ascontiguousarray(vc[scattered[b]].reshape(-1, num_kv_heads, head_dim)[:ctx].transpose(1, 0, 2))
        for b in range(batch)
    ]
    ref = contiguous_attention(q, ks, vs, scale)
    cpu_attention.paged_attention(out, q, kc, vc, scattered, lens, scale)
    assert np.allclose(out, ref, rtol=1e-3, atol=1e-4), "paged and contiguous disagree"
    t_paged = best_time(lambda: cpu_attention.paged_attention(out, q, kc, vc, scattered, lens, scale))
    t_consec = best_time(lambda: cpu_attention.paged_attention(out, q, kc, vc, consecutive, lens, scale))
    t_contig = best_time(lambda: contiguous_attention(q, ks, vs, scale))
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * 4
    return dict(
        batch=batch,
        context=ctx,
        paged_ms=t_paged * 1e3,
        consecutive_ms=t_consec * 1e3,
        contiguous_ms=t_contig * 1e3,
        paged_over_contiguous=t_paged / t_contig,
        paged_GBps=kv_bytes / t_paged / 1e9,
        contiguous_GBps=kv_bytes / t_contig / 1e9,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--num-heads", type=int, default=9)
    ap.add_argument("--num-kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda runs benchmarks/kernels_cuda.py (head_dim 64 and 128, fp32 and bf16)",
    )
    ap.add_argument(
        "--engine-dispatch",
        action="store_true",
        help="keep the engine's serial/parallel choice (small calls serial, which wins next to "
        "BLAS in the engine); default: always the parallel kernel",
    )
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from benchmarks import kernels_cuda

        return kernels_cuda.main(["--out", args.out])
    if not args.engine_dispatch:
        cpu_attention.PARALLEL_MIN_WORK = 0  # measure the parallel kernel everywhere (see --engine-dispatch)
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    print(f"measured copy bandwidth (read + write): {bw / 1e9:.1f} GB/s")
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            r = run_case(rng, batch, ctx, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size)
            r["paged_pct_of_copy_bw"] = 100 * r["paged_GBps"] * 1e9 / bw
            rows.append(r)
    print_table(
        rows,
        [
            "batch",
            "context",
            "paged_ms",
            "consecutive_ms",
            "contiguous_ms",
            "paged_over_contiguous",
            "paged_GBps",
            "contiguous_GBps",
            "paged_pct_of_copy_bw",
        ],
    )
    write_json(
        Path(args.out) / "kernels_cpu.json",
        {
            "conditions": conditions(
                num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads,
                dispatch="engine" if args.engine_dispatch else "parallel kernel always",
                head_dim=args.head_dim,
                block_size=args.block_size,
                kv_dtype="float32",
            ),
            "copy_bandwidth_GBps": bw / 1e9,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
