"""The CUDA backend's token selection (``cuda/sampling.cu``): structured outputs' bitmask on the logits, the
sampling parameters' sparse logits edits, and the sampler (temperature, top-k, top-p, min-p, one
inverse-CDF draw per sample; the semantics of ``rawpaged.testing.reference_sampler.sample``)."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cuda import launch_config
from rawpaged.kernels.cuda.launch import ctype, i32, i64, row_stride


def apply_token_bitmask(ctx, logits, bitmask, rows):
    """Structured outputs: the logits of the tokens a bitmask forbids set to ``-inf``, in place, on
    the device (see ``rawpaged.kernels.cpu.sampling.apply_token_bitmask`` for the layout;
    ``cuda/sampling.cu`` for the kernel).
    ``bitmask`` int32 ``[n, words]`` and ``rows`` ``[n]`` are host arrays (uploaded, 4 bytes a word).

    Raises:
        ValueError on shapes or dtypes that do not fit.
    """
    act = ctype(logits, "logits")
    num_rows, vocab = logits.shape
    rows = np.asarray(rows, dtype=np.int64)
    bitmask = np.ascontiguousarray(bitmask)
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask must be int32 [{rows.shape[0]}, words], got {bitmask.dtype} {bitmask.shape}")
    if rows.size == 0:
        return
    if rows.min() < 0 or rows.max() >= num_rows:
        raise ValueError(f"rows must index the {num_rows} logits rows")
    threads = 256
    ctx.kernel(
        act,
        act,
        f"apply_token_bitmask_kernel<{act}>",
        (-(-vocab // threads), rows.shape[0], 1),
        (threads, 1, 1),
        (
            logits,
            i64(row_stride(logits, "logits", 1)),
            ctx.to_device(bitmask, np.int32),
            i32(bitmask.shape[1]),
            ctx.to_device(rows, np.int32),
            i32(vocab),
        ),
    )


def apply_logits_edits(ctx, logits, edits):
    """Sampling parameters' sparse logits edits (``LogitsEdits``: penalties, logit bias, banned tokens),
    in place, on the device, one block per edited row (see ``rawpaged.kernels.cpu.sampling.apply_logits_edits``
    for the semantics; ``cuda/sampling.cu`` for the kernel). The edits are host arrays, uploaded.

    Raises:
        ValueError on a row or token id that does not fit.
    """
    act = ctype(logits, "logits")
    num_rows, vocab = logits.shape
    rows = np.asarray(edits.rows, dtype=np.int64)
    if rows.size == 0:
        return
    if rows.min() < 0 or rows.max() >= num_rows:
        raise ValueError(f"edits.rows must index the {num_rows} logits rows")
    for name in ("add_ids", "rep_ids", "count_ids"):
        ids = getattr(edits, name)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"edits.{name} must be token ids below the vocabulary size {vocab}")

    def up(a, dtype):  # the kernel never reads an empty segment, but every pointer must be valid
        a = np.asarray(a, dtype=dtype)
        return ctx.to_device(a if a.size else np.zeros(1, dtype), dtype)

    ctx.kernel(
        act,
        act,
        f"apply_logits_edits_kernel<{act}>",
        (rows.shape[0], 1, 1),
        (128, 1, 1),
        (
            logits,
            i64(row_stride(logits, "logits", 1)),
            up(rows, np.int32),
            up(edits.add_start, np.int32),
            up(edits.add_ids, np.int32),
            up(edits.add_values, np.float32),
            up(edits.rep_start, np.int32),
            up(edits.rep_ids, np.int32),
            up(edits.repetition, np.float32),
            up(edits.count_start, np.int32),
            up(edits.count_ids, np.int32),
            up(edits.counts, np.float32),
            up(edits.frequency, np.float32),
            up(edits.presence, np.float32),
        ),
    )


def sample(ctx, logits, sample_rows, temperature, top_k, top_p, min_p, uniforms):
    """Token ids drawn on the device from rows of ``logits [num_rows, vocab]`` (see
    ``rawpaged.testing.reference_sampler.sample`` for the semantics; ``cuda/sampling.cu`` for the
    kernel). The per-sample arguments are host arrays ``[num_samples]``; two small packed uploads go
    in, int32 ids come back (4 bytes a sample).
    Returns int64 ``[num_samples]`` on the host.
    """
    act = ctype(logits, "logits")
    num_rows, vocab = logits.shape
    n = len(sample_rows)
    rows = np.asarray(sample_rows, dtype=np.int64)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if rows.min() < 0 or rows.max() >= num_rows:
        raise ValueError(f"sample_rows must index the {num_rows} logits rows, got {rows.tolist()}")
    ints = np.stack([rows, np.asarray(top_k, dtype=np.int64)], axis=1).astype(np.int32)
    floats = np.stack([np.asarray(a, dtype=np.float32) for a in (temperature, top_p, min_p, uniforms)], axis=1)
    out = ctx.xp.empty(n, dtype=np.int32)
    # the tempered probabilities in shared memory when a row fits beside the kernel's static shared
    # memory (49152 floats: 192 KiB of the 227 KiB opt-in on Hopper), else in a global workspace
    name = f"sample_kernel<{act}>"
    static = getattr(ctx.launch, "static_smem_bytes", None)
    static = static(act, act, name) if static is not None else launch_config.SAMPLE_STATIC_SMEM_BYTES
    smem = launch_config.sample_smem_bytes(vocab, ctx.max_smem_optin, static)
    probs = np.uint64(0) if smem else ctx.xp.empty((n, vocab), dtype=np.float32)
    ctx.kernel(
        act,
        act,
        name,
        (n, 1, 1),
        (launch_config.sample_threads(vocab), 1, 1),
        (
            out,
            logits,
            i64(row_stride(logits, "logits", 1)),
            ctx.to_device(ints, np.int32),
            ctx.to_device(floats, np.float32),
            probs,
            i32(vocab),
            i32(smem > 0),
        ),
        smem,
    )
    host = out.get() if hasattr(out, "get") else np.asarray(out)
    return host.astype(np.int64)
