"""The CPU's mixture-of-experts kernels (Numba), float32 experts: the router's top-k, tokens grouped by
expert, the grouped products over each expert's rows and the weighted scatter back.

One step of a sparse MoE block (``model_executor.layers.fused_moe``) over ``T`` tokens, ``E`` experts of
which each token takes ``k``:

1. ``moe_route``: router logits ``[T, E]`` -> each token's ``k`` experts and their weights, with the
   architecture's normalization (softmax over all ``E`` then top-k, optionally renormalized: Qwen2-MoE,
   Qwen3-MoE; or top-k of the logits then a softmax over the ``k``: Mixtral). Ties go to the lower expert
   index.
2. ``moe_align``: the ``T * k`` (token, slot) pairs sorted by expert (stable: token order within an
   expert), with each expert's offsets into that order (vLLM's ``moe_align_block_size``, without padding
   to blocks).
3. ``grouped_linear``: the rows of each expert times that expert's weight, in one parallel kernel over
   (expert, tile of weight rows) tasks of the experts that have rows: an expert no token selected is
   never read, each used expert's weights are streamed from memory once per call. An expert's rows go
   four at a time through ``gemm``'s register tiles (4 x 6 or 4 x 3 dot products along K together), the
   rows past the last multiple of 4 through dot products of four weight rows at a time.
4. ``moe_combine``: each token's ``k`` outputs weighted and summed, in slot order (so a token's result
   does not depend on the other tokens of the step).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from rawpaged.kernels.cpu.gemm import GEMM_TILE_N, TILE_M, _tile_4x1, _tile_4x3, _tile_4x6, gemv_rows
from rawpaged.kernels.cpu.jit import JIT

#: the exact kernels (routing, counting sort, scatter): no fastmath, so ties and NaNs compare as written
_EXACT = dict(cache=True, nogil=True)
#: weight rows a task of ``grouped_linear`` takes: a multiple of the register tiles' 6 and 3 and the GEMV's 4
#: (the task's weight rows stay in L2 across the expert's rows, each tile's in L1 across its row tiles)
TILE_N = 48


@nb.njit(**_EXACT)
def _route(logits, top_k, softmax_before_topk, renormalize, ids, weights):
    T, E = logits.shape
    probs = np.empty(E, np.float64)
    taken = np.zeros(E, np.bool_)
    for t in range(T):
        row = logits[t]
        if softmax_before_topk:
            m = -np.inf
            for e in range(E):
                if row[e] > m:
                    m = row[e]
            s = 0.0
            for e in range(E):
                probs[e] = np.exp(np.float64(row[e]) - m)
                s += probs[e]
            for e in range(E):
                probs[e] /= s
        else:
            for e in range(E):
                probs[e] = row[e]
        taken[:] = False
        for j in range(top_k):
            best = -1
            for e in range(E):  # strictly greater: the lower index wins a tie
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
        if softmax_before_topk:
            s = 0.0
            for j in range(top_k):
                s += probs[ids[t, j]]
            for j in range(top_k):
                p = probs[ids[t, j]]
                weights[t, j] = p / s if renormalize else p
        else:  # a softmax over the k selected logits (the largest is the first)
            m = probs[ids[t, 0]]
            s = 0.0
            for j in range(top_k):
                s += np.exp(probs[ids[t, j]] - m)
            for j in range(top_k):
                weights[t, j] = np.exp(probs[ids[t, j]] - m) / s


def moe_route(router_logits, top_k: int, softmax_before_topk: bool, renormalize: bool) -> tuple:
    """Each token's ``top_k`` experts and their weights.

    router_logits: float32 ``[T, E]``. ``softmax_before_topk``: the weights are the softmax over all E
    logits of the selected experts, divided by their sum when ``renormalize`` (Qwen2-MoE, Qwen3-MoE with
    ``norm_topk_prob``); else the softmax over the k selected logits (Mixtral; ``renormalize`` changes
    nothing). The experts are the k largest (in the order of their values, the lower index first among
    equal ones); sums and exponentials in float64. Returns ``(topk_ids int32 [T, k], topk_weights float32
    [T, k])``. Raises ValueError for ``top_k`` outside ``[1, E]``.
    """
    logits = np.ascontiguousarray(router_logits, dtype=np.float32)
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k {top_k} must be in [1, {E}] (the number of experts)")
    ids = np.empty((T, top_k), np.int32)
    weights = np.empty((T, top_k), np.float32)
    _route(logits, int(top_k), bool(softmax_before_topk), bool(renormalize), ids, weights)
    return ids, weights


@nb.njit(**_EXACT)
def _align(flat_ids, num_experts, sorted_ids, offsets):
    for i in range(flat_ids.shape[0]):
        offsets[flat_ids[i] + 1] += 1
    for e in range(num_experts):
        offsets[e + 1] += offsets[e]
    fill = offsets[:-1].copy()
    for i in range(flat_ids.shape[0]):
        e = flat_ids[i]
        sorted_ids[fill[e]] = i
        fill[e] += 1


def moe_align(topk_ids, num_experts: int) -> tuple:
    """The (token, slot) pairs of ``topk_ids`` (int ``[T, k]``) grouped by expert: ``(sorted_ids int32 [T *
    k], expert_offsets int64 [E + 1])``, where ``sorted_ids`` holds flat indices ``t * k + j`` in expert
    order (stable: ascending within an expert) and expert e's are ``sorted_ids[expert_offsets[e] :
    expert_offsets[e + 1]]``. Raises ValueError for an id outside ``[0, num_experts)``."""
    flat = np.ascontiguousarray(topk_ids, dtype=np.int32).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"moe_align: expert ids must be in [0, {num_experts}), got {flat.min()}..{flat.max()}")
    sorted_ids = np.empty(flat.size, np.int32)
    offsets = np.zeros(num_experts + 1, np.int64)
    _align(flat, int(num_experts), sorted_ids, offsets)
    return sorted_ids, offsets


@nb.njit(**_EXACT)
def _tasks(offsets, N, tile):
    """(expert, first weight row) of each task: the tiles of the experts that have rows."""
    E = offsets.shape[0] - 1
    tiles = (N + tile - 1) // tile
    used = 0
    for e in range(E):
        if offsets[e + 1] > offsets[e]:
            used += 1
    task_e = np.empty(used * tiles, np.int64)
    task_n = np.empty(used * tiles, np.int64)
    i = 0
    for e in range(E):
        if offsets[e + 1] > offsets[e]:
            for t in range(tiles):
                task_e[i] = e
                task_n[i] = t * tile
                i += 1
    return task_e, task_n


@nb.njit(**JIT)
def _tiles(x, w, out, n0, n1):
    """``out[:, n0:n1] = x @ w[n0:n1].T`` for ``x [Mt, K]``, Mt a multiple of ``gemm.TILE_M``: ``gemm``'s
    register tiles (4 rows by ``GEMM_TILE_N`` weight rows), weight rows past the last whole tile 4 x 1."""
    nt = n0 + (n1 - n0) // GEMM_TILE_N * GEMM_TILE_N
    for n in range(n0, nt, GEMM_TILE_N):
        for m in range(0, x.shape[0], TILE_M):
            if GEMM_TILE_N == 6:
                _tile_4x6(x, w, out, m, n, n)
            else:
                _tile_4x3(x, w, out, m, n, n)
    for n in range(nt, n1):
        for m in range(0, x.shape[0], TILE_M):
            _tile_4x1(x, w, out, m, n)


@nb.njit(parallel=True, **JIT)
def _grouped(x, offsets, w, task_e, task_n, tile, out):
    N = w.shape[1]
    for i in nb.prange(task_e.shape[0]):
        e, n0 = task_e[i], task_n[i]
        n1 = min(n0 + tile, N)
        r0, r1 = offsets[e], offsets[e + 1]
        tiled = r0 + (r1 - r0) // TILE_M * TILE_M  # the expert's rows in whole register tiles, then the rest
        if tiled > r0:
            _tiles(x[r0:tiled], w[e], out[r0:tiled], n0, n1)
        for r in range(tiled, r1):
            gemv_rows(x[r], w[e], out[r], n0, n1)


def grouped_linear(x, expert_offsets, experts) -> np.ndarray:
    """``out[r] = x[r] @ experts[e].T`` for the rows ``r`` of each expert ``e``
    (``expert_offsets[e] <= r < expert_offsets[e + 1]``).

    x: float32 ``[M, K]``, rows in expert order (``moe_align``); expert_offsets: int64 ``[E + 1]`` with
    ``expert_offsets[E] == M``; experts: float32 ``[E, N, K]`` (``load_experts``). Returns float32 ``[M,
    N]``. An expert with no rows is never read. Raises ValueError for shapes that disagree.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    offsets = np.ascontiguousarray(expert_offsets, dtype=np.int64)
    E, N, K = experts.shape
    if x.ndim != 2 or x.shape[1] != K or offsets.shape != (E + 1,) or offsets[-1] != x.shape[0]:
        raise ValueError(
            f"grouped_linear: x {x.shape}, expert_offsets {offsets.shape} (last {offsets[-1]}) do not fit "
            f"experts {experts.shape}"
        )
    out = np.empty((x.shape[0], N), np.float32)
    task_e, task_n = _tasks(offsets, N, TILE_N)
    if task_e.size:
        _grouped(x, offsets, experts, task_e, task_n, TILE_N, out)
    return out


@nb.njit(**JIT)
def _combine(y, sorted_ids, weights, out):
    T, k = weights.shape
    H = y.shape[1]
    where = np.empty(sorted_ids.shape[0], np.int64)
    for i in range(sorted_ids.shape[0]):
        where[sorted_ids[i]] = i
    for t in range(T):
        for h in range(H):
            out[t, h] = 0.0
        for j in range(k):
            src = y[where[t * k + j]]
            wj = weights[t, j]
            for h in range(H):
                out[t, h] += wj * src[h]


def moe_combine(y, sorted_ids, topk_weights, num_tokens: int, shared=None, shared_gate=None) -> np.ndarray:
    """``out[t] = sum_j topk_weights[t, j] * y[i]`` where ``sorted_ids[i] == t * k + j``, summed in slot
    order j = 0 .. k - 1; with ``shared`` (Qwen2-MoE's shared expert), plus ``shared[t] *
    sigmoid(shared_gate[t])`` after the sum.

    y: float32 ``[T * k, H]`` in ``sorted_ids``' order; sorted_ids: int32 ``[T * k]`` (``moe_align``);
    topk_weights: float32 ``[T, k]``; shared: float32 ``[T, H]``, shared_gate: float32 ``[T, 1]`` (or
    both None). Returns float32 ``[num_tokens, H]``. Raises ValueError for shapes that disagree."""
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    if weights.shape[0] != num_tokens or y.shape[0] != weights.size or sorted_ids.shape[0] != weights.size:
        raise ValueError(
            f"moe_combine: y {y.shape}, sorted_ids {sorted_ids.shape}, topk_weights {weights.shape} "
            f"disagree with {num_tokens} tokens"
        )
    if shared is not None and (shared.shape != (num_tokens, y.shape[1]) or shared_gate is None):
        raise ValueError(f"moe_combine: shared {shared.shape} must be [{num_tokens}, {y.shape[1]}] with its gate")
    out = np.empty((num_tokens, y.shape[1]), np.float32)
    _combine(np.ascontiguousarray(y, dtype=np.float32), np.ascontiguousarray(sorted_ids), weights, out)
    if shared is not None:
        out += shared * (np.float32(1.0) / (np.float32(1.0) + np.exp(-shared_gate)))
    return out


def load_experts(parts: list) -> np.ndarray:
    """Float expert stacks ``[E, N_i, K]`` concatenated along N -> one C-contiguous float32 ``[E, sum N_i,
    K]`` (what ``grouped_linear`` takes). Raises ValueError for parts that disagree in E or K."""
    shapes = [tuple(p.shape) for p in parts]
    if any(len(s) != 3 or s[0] != shapes[0][0] or s[2] != shapes[0][2] for s in shapes):
        raise ValueError(f"load_experts: expert stacks {shapes} must be [E, N_i, K] with one E and one K")
    if len(parts) == 1:
        return np.array(parts[0], dtype=np.float32, order="C")
    return np.ascontiguousarray(np.concatenate([np.asarray(p, dtype=np.float32) for p in parts], axis=1))
