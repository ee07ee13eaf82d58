"""CPU (Numba) kernels against float64 references, blocks scattered randomly, outputs NaN-poisoned."""

import numba as nb
import numpy as np
import pytest

from rawpaged.kernels.cpu import attention as cpu_attention
from rawpaged.kernels.cpu import cache as cpu_cache
from rawpaged.kernels.cpu import elementwise as cpu_elementwise
from rawpaged.kernels.cpu import gemm as cpu_gemm
from rawpaged.kernels.cpu import intrinsics as cpu_intrinsics
from rawpaged.kernels.cpu import paged_attention_v2
from tests.kv_reference import (
    BF16,
    assert_cache_rows_written,
    assert_prefill_matches,
    attention_ref,
    copy_blocks_expected,
    make_paged_kv,
    poison_before,
    rms_norm_ref,
    rope_cache,
    rope_ref,
)

CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 1000]
GROUPS = [1, 2, 4, 8, 16, 3, 6]
DTYPES = [np.float32, BF16]


def _tol(dtype):
    return dict(rtol=2e-4, atol=2e-5)


@pytest.fixture(params=["serial", "parallel"])
def numba_mode(request, monkeypatch):
    """Run the Numba attention kernels in their serial and their parallel (prange) build."""
    monkeypatch.setattr(cpu_attention, "PARALLEL_MIN_WORK", 1 << 62 if request.param == "serial" else 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
def test_paged_attention_matches_float64(dtype, head_dim, group, numba_mode):
    rng = np.random.default_rng(group * 1000 + head_dim)
    num_kv_heads, block_size = 2, 16
    num_heads = num_kv_heads * group
    kc, vc, bt, keys, values = make_paged_kv(rng, CONTEXTS, num_kv_heads, head_dim, block_size, dtype)
    q = rng.standard_normal((len(CONTEXTS), num_heads, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    scale = head_dim**-0.5
    cpu_attention.paged_attention(out, q, kc, vc, bt, np.array(CONTEXTS, np.int32), scale)
    for s, ctx in enumerate(CONTEXTS):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], scale)[0]
        np.testing.assert_allclose(out[s], ref, **_tol(dtype), err_msg=f"ctx={ctx}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 100, 512])
def test_paged_attention_split_context_matches_float64(dtype, window, numba_mode):
    """Gemma 3's shape (one KV head for 4 query heads of 256) at batch 1 to 3 leaves threads idle, so the
    contexts are split into ``PARTITION_SIZE`` runs merged at the end (vLLM's v2); contexts within,
    at and across partition edges, windows inside one partition and across several. Positions before
    a window hold NaN, so a single read of them would show."""
    rng = np.random.default_rng(7 if window is None else window)
    num_kv_heads, group, head_dim = 1, 4, 256
    part = paged_attention_v2.PARTITION_SIZE
    assert paged_attention_v2.decode_partition(1, num_kv_heads) == part
    scale = head_dim**-0.5
    for contexts in ([1], [part - 1], [part + 1], [1000], [2 * part, 17, 5 * part - 3]):
        kc, vc, bt, keys, values = make_paged_kv(rng, contexts, num_kv_heads, head_dim, 16, dtype)
        if window is not None:
            poison_before(kc, vc, bt, [max(0, c - window) for c in contexts])
        q = rng.standard_normal((len(contexts), group, head_dim)).astype(np.float32)
        out = np.full_like(q, np.nan)
        lens = np.array(contexts, np.int32)
        cpu_attention.paged_attention(out, q, kc, vc, bt, lens, scale, sliding_window=window)
        for s, ctx in enumerate(contexts):
            ref = attention_ref(q[s : s + 1], keys[s], values[s], scale, window=window)[0]
            np.testing.assert_allclose(out[s], ref, **_tol(dtype), err_msg=f"ctx={ctx} of {contexts}")


def test_paged_attention_one_partition_equals_the_whole_context_kernel():
    """A context of one partition (a short one, or a window that starts on a partition's edge) merges to
    exactly what the unsplit kernel computes, so the split changes nothing below ``PARTITION_SIZE``."""
    rng = np.random.default_rng(3)
    part = paged_attention_v2.PARTITION_SIZE
    contexts = [part, 5, 3 * part]
    kc, vc, bt, _, _ = make_paged_kv(rng, contexts, 1, 256, 16, np.float32)
    q = rng.standard_normal((len(contexts), 4, 256)).astype(np.float32)
    lens, none = np.array(contexts, np.int32), np.zeros((1, 1, 1), np.float32)
    split, whole = np.full_like(q, np.nan), np.full_like(q, np.nan)
    args = (q, kc, vc, none, none, bt, lens, np.float32(1 / 16), 1, part, np.float32(0))
    paged_attention_v2.paged_attention_v2_parallel(split, *args, part)
    cpu_attention.paged_attention_parallel(whole, *args)
    np.testing.assert_array_equal(split, whole)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_attention_causal_chunked(dtype, block_size, numba_mode):
    """Full prefill, prefill after a cached prefix, and a one-token chunk, in one call."""
    rng = np.random.default_rng(block_size)
    num_kv_heads, group, head_dim = 3, 3, 64
    num_heads = num_kv_heads * group
    seq_lens = [17, 33, 40, 1, 100, 16]
    new_tokens = [17, 1, 24, 1, 37, 16]  # full / decode-like / chunk after prefix / single / chunk / exact block
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], num_heads, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(out, q, kc, vc, bt, qsl, np.array(seq_lens, np.int32), head_dim**-0.5)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, head_dim**-0.5, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 16, 37])
def test_paged_attention_sliding_window(dtype, window, numba_mode):
    """Each query sees its last ``window`` positions; the positions before them hold NaN, so a single
    read of them would show."""
    rng = np.random.default_rng(window)
    contexts = [1, 5, 16, 17, 40, 300]
    num_kv_heads, group, head_dim = 2, 3, 64
    kc, vc, bt, keys, values = make_paged_kv(rng, contexts, num_kv_heads, head_dim, 16, dtype)
    poison_before(kc, vc, bt, [max(0, c - window) for c in contexts])
    q = rng.standard_normal((len(contexts), num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    cpu_attention.paged_attention(out, q, kc, vc, bt, np.array(contexts, np.int32), 0.125, sliding_window=window)
    for s, ctx in enumerate(contexts):
        ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.125, window=window)[0]
        np.testing.assert_allclose(out[s], ref, **_tol(dtype), err_msg=f"ctx={ctx}")
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_attention.paged_attention(out, q, kc, vc, bt, np.array(contexts, np.int32), 0.125, sliding_window=0)


@pytest.mark.parametrize("window", [1, 8, 100, 259])
def test_prefill_attention_sliding_window(window, numba_mode):
    """Windowed prefill on both CPU paths: the per-token Numba kernel (short chunks) and the BLAS-tiled
    one (>= 32 new tokens; 600 positions span three 256-key tiles, the window starting inside one)."""
    rng = np.random.default_rng(window)
    seq_lens = [40, 300, 600, 20, 33]
    new_tokens = [40, 1, 300, 7, 33]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 64, 16, np.float32)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], 4, 64)).astype(np.float32)
    out = np.full_like(q, np.nan)
    poisoned = (kc.copy(), vc.copy())
    # NaN in the blocks wholly before each sequence's first new token's window: never read
    firsts = [max(0, s - n + 1 - window) for s, n in zip(seq_lens, new_tokens)]
    poison_before(*poisoned, bt, [f - f % 16 for f in firsts])
    cpu_attention.prefill_attention(
        out, q, *poisoned, bt, qsl, np.array(seq_lens, np.int32), 0.125, sliding_window=window
    )
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=window)
    # A window as long as the sequence is plain causal attention.
    full = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(full, q, kc, vc, bt, qsl, np.array(seq_lens, np.int32), 0.125, sliding_window=600)
    assert_prefill_matches(full, q, qsl, seq_lens, keys, values, 0.125)


@pytest.mark.parametrize("cap", [2.0, 50.0])
def test_paged_attention_logits_soft_cap(cap, numba_mode):
    """Gemma 2's soft-cap ``c * tanh(s / c)`` of the scaled scores, with and without a window; a cap of 0
    (or None) is no cap, a negative one is refused."""
    rng = np.random.default_rng(int(cap))
    contexts = [1, 17, 40, 300]
    kc, vc, bt, keys, values = make_paged_kv(rng, contexts, 2, 64, 16, BF16)
    q = (rng.standard_normal((len(contexts), 6, 64)) * 3).astype(np.float32)  # scores well past a cap of 2
    lens = np.array(contexts, np.int32)
    for window in (None, 20):
        out = np.full_like(q, np.nan)
        cpu_attention.paged_attention(out, q, kc, vc, bt, lens, 0.125, sliding_window=window, logits_soft_cap=cap)
        for s in range(len(contexts)):
            ref = attention_ref(q[s : s + 1], keys[s], values[s], 0.125, window=window, soft_cap=cap)[0]
            np.testing.assert_allclose(out[s], ref, rtol=2e-4, atol=2e-5, err_msg=f"ctx={contexts[s]}")
    uncapped = attention_ref(q[3:], keys[3], values[3], 0.125)[0]
    assert cap > 10 or not np.allclose(out[3], uncapped, atol=1e-2), "the cap should change the result"
    plain = np.full_like(q, np.nan)
    cpu_attention.paged_attention(plain, q, kc, vc, bt, lens, 0.125, logits_soft_cap=0)
    np.testing.assert_allclose(plain[3], uncapped, rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        cpu_attention.paged_attention(out, q, kc, vc, bt, lens, 0.125, logits_soft_cap=-1.0)


@pytest.mark.parametrize("window", [None, 8])
def test_prefill_attention_logits_soft_cap(window, numba_mode):
    """Soft-capped prefill on both CPU paths: the per-token Numba kernel (short chunks) and the BLAS-tiled
    one (>= 32 new tokens), with and without a window."""
    rng = np.random.default_rng(7)
    seq_lens = [40, 300, 20, 33]
    new_tokens = [40, 1, 7, 33]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 64, 16, np.float32)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = (rng.standard_normal((qsl[-1], 4, 64)) * 3).astype(np.float32)
    out = np.full_like(q, np.nan)
    lens = np.array(seq_lens, np.int32)
    cpu_attention.prefill_attention(out, q, kc, vc, bt, qsl, lens, 0.125, sliding_window=window, logits_soft_cap=3.0)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 0.125, window=window, soft_cap=3.0)


def test_gelu_tanh_and_mul_matches_float64():
    """PyTorch's ``gelu(g, approximate="tanh") * u`` in float64, over gates from -12 to 12 (both tails)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 2 * 300)) * 4).astype(np.float32)
    x[0, :300] = np.linspace(-12, 12, 300)
    g, u = x[:, :300].astype(np.float64), x[:, 300:].astype(np.float64)
    ref = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    np.testing.assert_allclose(cpu_elementwise.gelu_tanh_and_mul(x), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype):
    rng = np.random.default_rng(0)
    num_blocks, block_size, H, D = 9, 16, 3, 64
    kc = np.full((num_blocks, block_size, H, D), np.nan, np.float32).astype(dtype)
    vc = kc.copy()
    slots = rng.permutation(num_blocks * block_size)[:40].astype(np.int64)
    slots[[3, 17]] = -1
    key = rng.standard_normal((40, H, D)).astype(np.float32)
    value = rng.standard_normal((40, H, D)).astype(np.float32)
    cpu_cache.reshape_and_cache(key, value, kc, vc, slots)
    # Stored values equal the input rounded to the cache dtype (round-to-nearest-even for bf16).
    assert_cache_rows_written(kc, vc, key, value, slots)


def test_bf16_rounding_is_nearest_even():
    vals = np.array([1.0, 1.00390625, 1.01171875, -3.3e38, 1e-40, 65504.0, np.inf, -np.inf], np.float32)
    key = np.tile(vals[:, None, None], (1, 1, 2)).astype(np.float32)  # [8, 1, 2]
    kc = np.zeros((1, 8, 1, 2), BF16)
    vc = np.zeros_like(kc)
    cpu_cache.reshape_and_cache(key, key, kc, vc, np.arange(8, dtype=np.int64))
    np.testing.assert_array_equal(kc[0, :, 0, 0].view(np.uint16), vals.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_copy_blocks_all_layers(dtype):
    rng = np.random.default_rng(1)
    shape = (10, 16, 3, 64)
    kcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    vcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    mapping = np.array([[2, 7], [5, 1], [2, 9]], np.int64)
    exp_k, exp_v = copy_blocks_expected(kcs, mapping), copy_blocks_expected(vcs, mapping)
    cpu_cache.copy_blocks(kcs, vcs, mapping)
    for layer in range(3):
        np.testing.assert_array_equal(kcs[layer], exp_k[layer])
        np.testing.assert_array_equal(vcs[layer], exp_v[layer])


@pytest.mark.parametrize(
    "mapping, message",
    [
        ([[2, 7], [3, 7]], "appears twice"),  # two writes to one block
        ([[2, 7], [7, 9]], "both a source and a destination"),  # a chain: 7's old or new contents?
        ([[2, 10]], r"in \[0, 10\)"),
        ([[-1, 3]], r"in \[0, 10\)"),
    ],
)
def test_copy_blocks_refuses_mappings_the_kernels_would_race_on(mapping, message):
    shape = (10, 16, 3, 64)
    kcs, vcs = [np.zeros(shape, np.float32)], [np.zeros(shape, np.float32)]
    kcs[0][2] = 1.0
    with pytest.raises(ValueError, match=message):
        cpu_cache.copy_blocks(kcs, vcs, np.array(mapping, np.int64))
    assert not kcs[0][7].any() and not kcs[0][3].any()  # refused before anything was copied


def test_rms_norm_rotary_silu_against_float64():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    res = rng.standard_normal((5, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    ref, s = rms_norm_ref(x, w, 1e-5, residual=res)
    res_in = res.copy()
    out = cpu_elementwise.rms_norm(x, w, 1e-5, residual=res_in)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res_in, s, rtol=1e-6)

    D, theta = 64, 100000.0
    cache = rope_cache(D, 50, theta)
    pos = np.array([0, 3, 49, 7], np.int64)
    q = rng.standard_normal((4, 9, D)).astype(np.float32)
    k = rng.standard_normal((4, 3, D)).astype(np.float32)

    rq, rk = rope_ref(q, pos, theta), rope_ref(k, pos, theta)
    cpu_elementwise.rotary_embedding(pos, q, k, cache)
    np.testing.assert_allclose(q, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, rk, rtol=1e-5, atol=1e-5)

    g = rng.standard_normal((3, 20)).astype(np.float32)
    gd = g.astype(np.float64)
    np.testing.assert_allclose(
        cpu_elementwise.silu_and_mul(g), gd[:, :10] / (1 + np.exp(-gd[:, :10])) * gd[:, 10:], rtol=1e-5, atol=1e-6
    )


@nb.njit
def _exp_each(x):
    out = np.full_like(x, np.nan)
    for i in range(x.shape[0]):
        out[i] = cpu_intrinsics.exp_f32(x[i])
    return out


def test_vector_exp_against_float64_and_its_clamp():
    x = np.concatenate([np.linspace(-87, 88, 400_001, dtype=np.float32), np.float32([0, -1e-8, 1e-8, -0.5, 0.5])])
    ref = np.exp(x.astype(np.float64))
    got = _exp_each(x)
    rel = np.abs(got - ref) / ref
    assert rel.max() < 3e-7, (x[rel.argmax()], rel.max())  # ~2 ulp of float32
    # outside [-87, 88] it is the bound's value: finite, never inf or 0 (the kernels' masks rely on it)
    edge = _exp_each(np.float32([-1e30, -200, 100, 1e30]))
    np.testing.assert_allclose(edge, np.exp([-87.0, -87.0, 88.0, 88.0]), rtol=3e-7)


@nb.njit
def _exp_f64_each(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = cpu_intrinsics.exp_f64(x[i])
    return out


def test_vector_exp_f64_within_an_ulp_of_numpy_and_flushed_below_minus_708():
    rng = np.random.default_rng(2)
    x = np.concatenate([-np.linspace(0, 707.99, 1_000_001), -rng.exponential(1e-9, 1000), [0.0, -0.0, -1e-300]])
    got, ref = _exp_f64_each(x), np.exp(x)
    assert (np.abs(got - ref) <= np.spacing(ref)).all(), x[np.argmax(np.abs(got - ref) / np.spacing(ref))]
    assert _exp_f64_each(np.array([-708.0, -745.0, -1e300, -np.inf])).tolist() == [0.0] * 4  # never NaN


def test_silu_and_mul_against_float64_over_the_whole_range():
    rng = np.random.default_rng(4)
    g = np.concatenate([rng.standard_normal((6, 700)) * 8, np.linspace(-120, 120, 6 * 100).reshape(6, 100)], axis=1)
    x = np.concatenate([g, rng.standard_normal(g.shape)], axis=1).astype(np.float32)
    xd = x.astype(np.float64)
    inter = g.shape[1]
    ref = xd[:, :inter] / (1 + np.exp(-xd[:, :inter])) * xd[:, inter:]
    got = cpu_elementwise.silu_and_mul(x[1:])  # a view that starts mid-buffer
    np.testing.assert_allclose(got, ref[1:], rtol=2e-6, atol=1e-30)


# (seq_lens, new tokens): after a 220-token prefix / whole prompt / short chunk (Numba kernel); the
# tiles' products through BLAS (605 tokens in the step), or through cpu_gemm (105 tokens <= SMALL_M)
LONG_CASES = [([520, 300, 40], [300, 300, 5]), ([300, 40], [100, 5])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("seq_lens,new_tokens", LONG_CASES, ids=["blas", "numba"])
def test_prefill_attention_long_sequences_cross_kv_tiles(dtype, seq_lens, new_tokens):
    """Prompts longer than one KV tile, after a cached prefix, beside a short chunk: both prefill paths."""
    assert (sum(new_tokens) <= cpu_gemm.SMALL_M) == (new_tokens[0] == 100)
    rng = np.random.default_rng(11)
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], num_kv_heads * group, head_dim)).astype(np.float32)
    out = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(out, q, kc, vc, bt, qsl, np.array(seq_lens, np.int32), head_dim**-0.5)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, head_dim**-0.5, **_tol(dtype))
