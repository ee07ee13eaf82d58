"""KV memory of a hybrid model with KV cache groups on and off (``disable_hybrid_kv_cache_manager``), in bytes
the pool actually hands out, measured by driving the real ``KVCacheManager`` (no model).

Model shape: Gemma 3's attention (``--layers`` 18 layers, every 6th global, the others a sliding window of
``--window`` 512; 1 KV head x 256; blocks of 16; ``--kv-dtype`` bfloat16). With groups on, the layers page in
6 groups of 3 (one full, five sliding), a block holds 3 layers' K and V, and a sliding group gives back the
blocks its window has passed; off, one group of every layer keeps every block.

1. One ``--seq-len`` (8192) token sequence: its prompt is prefilled in chunks of ``--chunk`` tokens (each
   chunk's KV written before its tokens attend, so a sliding group holds the chunk plus W - 1 tokens while
   it runs), then it decodes to ``--seq-len`` tokens one at a time. Reported: the bytes of the blocks it
   holds at the end and at its peak, on and off, and their ratios (the floor: full layers hold every token,
   sliding ones ``ceil(W / 16) + 1`` blocks).
2. Concurrent ``--concurrent-len`` (4096) token sequences in the same pool bytes (``--pool-gib``): sequences
   are built one after the other, each to its full length as above, until the pool refuses a block; the
   number held at once, on and off.

Usage: ``python benchmarks/hybrid_kv_memory.py [--out benchmarks/out/hybrid_kv_memory.json] [--chunk N]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import conditions, print_table, write_json  # noqa: E402
from rawpaged.core.kv_cache_groups import group_layers, group_size  # noqa: E402
from rawpaged.core.kv_cache_manager import KVCacheManager  # noqa: E402
from rawpaged.core.sequence import Sequence  # noqa: E402
from rawpaged.model_executor.model_runner import kv_block_bytes  # noqa: E402
from rawpaged.sampling_params import SamplingParams  # noqa: E402

MODES = {"hybrid": True, "hybrid-off": False}


def layer_windows(num_layers: int, window: int, every: int) -> list:
    """Gemma 3's pattern: layer i is global (None) when ``(i + 1) % every == 0``, else sliding."""
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def build_sequence(kv: KVCacheManager, seq: Sequence, prompt_len: int, total_len: int, chunk: int, block_bytes: int):
    """Run ``seq`` to ``total_len`` tokens through ``kv`` (prefill chunks, then decode steps), as the scheduler
    allocates; returns ``(peak bytes, bytes at the end)`` it held, or None when the pool ran out."""
    peak = 0
    while seq.num_computed_tokens < total_len:
        n = min(chunk, prompt_len - seq.num_computed_tokens) if seq.num_computed_tokens < prompt_len else 1
        if not kv.allocate_slots(seq, n):
            return None
        peak = max(peak, sum(map(len, kv.group_blocks(seq))) * block_bytes)
        seq.num_computed_tokens += n
    kv.remove_skipped_blocks(seq)  # what the next step would give back first
    return peak, sum(map(len, kv.group_blocks(seq))) * block_bytes


def _manager(args, hybrid: bool, pool_bytes: int) -> tuple:
    groups = group_layers(layer_windows(args.layers, args.window, args.every), hybrid=hybrid)
    block_bytes = kv_block_bytes(group_size(groups), args.block_size, args.kv_heads, args.head_dim, args.kv_dtype)
    kv = KVCacheManager(max(1, pool_bytes // block_bytes), args.block_size, groups=groups)
    return kv, groups, block_bytes


def _seq(i: int, length: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, [0] * length, SamplingParams(), None, 0.0)


def one_sequence(args) -> list:
    rows = []
    full = kv_block_bytes(args.layers, args.block_size, args.kv_heads, args.head_dim, args.kv_dtype)
    big = -(-args.seq_len // args.block_size) * full * 2  # room for it either way
    for mode, hybrid in MODES.items():
        kv, groups, block_bytes = _manager(args, hybrid, big)
        prompt = args.seq_len - args.decode_tokens
        peak, end = build_sequence(kv, _seq(0, args.seq_len), prompt, args.seq_len, args.chunk, block_bytes)
        rows.append(
            dict(mode=mode, groups=len(groups), layers_per_block=group_size(groups), block_bytes=block_bytes,
                 peak_bytes=peak, end_bytes=end, peak_mib=peak / 2**20, end_mib=end / 2**20)
        )  # fmt: skip
    off = rows[1]
    for r in rows:
        r["peak_vs_off"], r["end_vs_off"] = r["peak_bytes"] / off["peak_bytes"], r["end_bytes"] / off["end_bytes"]
    return rows


def concurrent(args) -> list:
    rows = []
    pool_bytes = int(args.pool_gib * 2**30)
    for mode, hybrid in MODES.items():
        kv, groups, block_bytes = _manager(args, hybrid, pool_bytes)
        held = 0
        while build_sequence(
            kv, _seq(held, args.concurrent_len), args.concurrent_len - 1, args.concurrent_len, args.chunk, block_bytes
        ):
            held += 1
        kv.check_invariants()
        rows.append(
            dict(mode=mode, pool_bytes=kv.num_blocks * block_bytes, num_blocks=kv.num_blocks, sequences=held,
                 bytes_per_seq=pool_bytes // max(held, 1))
        )  # fmt: skip
    rows[0]["vs_off"] = rows[0]["sequences"] / max(rows[1]["sequences"], 1)
    rows[1]["vs_off"] = 1.0
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--every", type=int, default=6, help="every n-th layer is global")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded one at a time at the end")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--concurrent-len", type=int, default=4096)
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--out", default="benchmarks/out/hybrid_kv_memory.json")
    args = ap.parse_args(argv)
    single, many = one_sequence(args), concurrent(args)
    print(f"one {args.seq_len}-token sequence (prefill chunks of {args.chunk}, then {args.decode_tokens} decodes):")
    print_table(single, ["mode", "groups", "layers_per_block", "block_bytes", "peak_mib", "end_mib", "peak_vs_off",
                         "end_vs_off"])  # fmt: skip
    print(f"\n{args.concurrent_len}-token sequences held at once in {args.pool_gib} GiB:")
    print_table(many, ["mode", "num_blocks", "pool_bytes", "sequences", "vs_off"])
    payload = {"conditions": conditions(**vars(args)), "one_sequence": single, "concurrent": many}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
