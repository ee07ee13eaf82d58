"""CudaBackend on a real GPU against the CPU backend and float64 references (``pytest -m cuda``; skipped
without a device). Same cases as tests/test_cuda_emulated.py, plus the CuPy-only parts (module compile,
cuBLAS linear, embedding)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rawpaged.kernels.cpu import attention as cpu_attention
from rawpaged.kernels.cpu import cache as cpu_cache
from tests.kv_reference import (
    BF16,
    assert_cache_rows_written,
    assert_prefill_matches,
    attention_ref,
    copy_blocks_expected,
    make_paged_kv,
    rms_norm_ref,
)
from tests.sampling_reference import SAMPLE_CASES, assert_draws_match, sample_args


def _no_gpu_reason() -> str | None:
    """Why these tests cannot run on a GPU here (None: they can)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        return f"CuPy is not importable ({type(e).__name__}); a CUDA host installs '.[cuda12]' or '.[cuda13]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, insufficient driver, ...
        return f"CuPy is installed but finds no CUDA device ({str(e).splitlines()[0][:120]})"
    return None if count > 0 else "CuPy is installed but the CUDA runtime reports 0 devices"


# scripts/gpu_check.sh sets RAWPAGED_REQUIRE_CUDA=1: there a missing GPU fails these tests instead of skipping.
_REQUIRED = os.environ.get("RAWPAGED_REQUIRE_CUDA") == "1"
# RAWPAGED_CUDA_TESTS_ON_EMULATION=1 runs this module on the CPU emulation of the kernels (slow; checks the
# tests themselves before a GPU session is spent on them); the CuPy-only tests are skipped then.
_EMULATED = os.environ.get("RAWPAGED_CUDA_TESTS_ON_EMULATION") == "1"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _REQUIRED and not _EMULATED and _no_gpu_reason() is not None, reason=str(_no_gpu_reason())),
]
cupy_only = pytest.mark.skipif(_EMULATED, reason="needs CuPy on a GPU (cuBLAS, device memory, the engine)")

CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 1000]
GROUPS = [1, 2, 4, 8, 16, 3, 6]
F16 = np.dtype(np.float16)


@pytest.fixture(scope="module")
def be():
    if _EMULATED:
        from tests.cuda_emu import Emulator, build, emulated_backend

        return emulated_backend(Emulator(build()), num_sms=8)
    from rawpaged.kernels.cuda.backend import CudaBackend

    return CudaBackend()


def tol(act):
    if act == BF16:
        return dict(rtol=1e-2, atol=1e-2)
    if act == F16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=2e-4, atol=2e-5)


def f64(a):
    return np.asarray(a).astype(np.float64)


@pytest.mark.parametrize("num_sms", [None, 1], ids=["auto-splits", "no-split"])
@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
def test_paged_attention(be, num_sms, cache_dtype, head_dim, group):
    rng = np.random.default_rng(group * 1000 + head_dim)
    kc, vc, bt, keys, values = make_paged_kv(rng, CONTEXTS, 2, head_dim, 16, cache_dtype)
    q = rng.standard_normal((len(CONTEXTS), 2 * group, head_dim)).astype(np.float32)
    ctx = np.array(CONTEXTS, np.int32)
    scale = head_dim**-0.5
    saved = be.num_sms
    if num_sms:
        be.num_sms = num_sms
    try:
        out_d = be.asarray(np.full_like(q, np.nan))
        be.paged_attention(out_d, be.asarray(q), be.asarray(kc), be.asarray(vc), bt, ctx, scale)
    finally:
        be.num_sms = saved
    out = be.to_numpy(out_d)
    ref_cpu = np.full_like(q, np.nan)
    cpu_attention.paged_attention(ref_cpu, q, kc, vc, bt, ctx, scale)
    np.testing.assert_allclose(out, ref_cpu, rtol=2e-4, atol=2e-5)
    for s, c in enumerate(CONTEXTS):
        np.testing.assert_allclose(
            out[s], attention_ref(q[s : s + 1], keys[s], values[s], scale)[0], rtol=2e-4, atol=2e-5, err_msg=f"ctx={c}"
        )


@pytest.mark.parametrize("act,cache", [(np.float32, F16), (F16, F16), (BF16, BF16)], ids=["f32-f16", "f16", "bf16"])
def test_paged_attention_half_precision(be, act, cache):
    rng = np.random.default_rng(11)
    contexts = [0, 3, 16, 47, 4000]
    kc, vc, bt, keys, values = make_paged_kv(rng, contexts[1:], 2, 128, 16, cache)
    bt = np.concatenate([np.zeros((1, bt.shape[1]), np.int32), bt])
    keys, values = [None] + keys, [None] + values
    q = rng.standard_normal((len(contexts), 8, 128)).astype(np.float32).astype(act)
    out_d = be.asarray(np.full(q.shape, np.nan, np.float32).astype(act))
    be.paged_attention(
        out_d, be.asarray(q), be.asarray(kc), be.asarray(vc), bt, np.array(contexts, np.int32), 128**-0.5
    )
    out = f64(be.to_numpy(out_d))
    np.testing.assert_array_equal(out[0], 0.0)
    for s in range(1, len(contexts)):
        ref = attention_ref(f64(q[s : s + 1]), keys[s], values[s], 128**-0.5)[0]
        np.testing.assert_allclose(out[s], ref, **tol(act))


@pytest.mark.parametrize("cache_dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size",
    [(3, 3, 64, 8), (3, 3, 64, 16), (3, 3, 64, 32), (2, 1, 128, 16), (1, 16, 64, 16), (2, 6, 128, 16)],
)
def test_prefill_attention(be, cache_dtype, num_kv_heads, group, head_dim, block_size):
    rng = np.random.default_rng(block_size + group)
    seq_lens = [17, 33, 40, 1, 100, 16, 300]
    new_tokens = [17, 1, 24, 1, 37, 16, 300]
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, num_kv_heads, head_dim, block_size, cache_dtype)
    qsl = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], num_kv_heads * group, head_dim)).astype(np.float32)
    out_d = be.asarray(np.full_like(q, np.nan))
    lens = np.array(seq_lens, np.int32)
    be.prefill_attention(out_d, be.asarray(q), be.asarray(kc), be.asarray(vc), bt, qsl, lens, head_dim**-0.5)
    out = be.to_numpy(out_d)
    ref_cpu = np.full_like(q, np.nan)
    cpu_attention.prefill_attention(ref_cpu, q, kc, vc, bt, qsl, lens, head_dim**-0.5)
    np.testing.assert_allclose(out, ref_cpu, rtol=2e-4, atol=2e-5)
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, head_dim**-0.5)


@pytest.mark.parametrize("act", [F16, BF16], ids=["f16", "bf16"])
def test_prefill_attention_half_precision(be, act):
    rng = np.random.default_rng(5)
    seq_lens = [20, 45]  # 20 and 13 new tokens
    kc, vc, bt, keys, values = make_paged_kv(rng, seq_lens, 2, 128, 16, act)
    qsl = np.array([0, 20, 33], np.int32)
    q = rng.standard_normal((33, 4, 128)).astype(np.float32).astype(act)
    out_d = be.asarray(np.full(q.shape, np.nan, np.float32).astype(act))
    be.prefill_attention(
        out_d,
        be.asarray(q),
        be.asarray(kc),
        be.asarray(vc),
        be.asarray(bt),
        be.asarray(qsl),
        be.asarray(np.array(seq_lens, np.int32)),
        128**-0.5,
        max_query_len=20,
    )
    out = f64(be.to_numpy(out_d))
    assert_prefill_matches(out, q, qsl, seq_lens, keys, values, 128**-0.5, **tol(act))


@pytest.mark.parametrize(
    "act,cache",
    [(np.float32, np.float32), (np.float32, BF16), (np.float32, F16), (BF16, BF16), (F16, F16)],
    ids=["f32", "f32-bf16", "f32-f16", "bf16", "f16"],
)
def test_reshape_and_cache(be, act, cache):
    rng = np.random.default_rng(0)
    num_blocks, block_size, H, D = 9, 16, 3, 64
    kc = np.full((num_blocks, block_size, H, D), np.nan, np.float32).astype(cache)
    slots = rng.permutation(num_blocks * block_size)[:40].astype(np.int64)
    slots[[3, 17]] = -1
    qkv = rng.standard_normal((40, (5 + 2 * H) * D)).astype(np.float32).astype(act)
    qkv_d = be.asarray(qkv)
    key_d = qkv_d[:, 5 * D : (5 + H) * D].reshape(40, H, D)
    value_d = qkv_d[:, (5 + H) * D :].reshape(40, H, D)
    kc_d, vc_d = be.asarray(kc), be.asarray(kc.copy())
    be.reshape_and_cache(key_d, value_d, kc_d, vc_d, slots)
    key = qkv[:, 5 * D : (5 + H) * D].reshape(40, H, D)
    value = qkv[:, (5 + H) * D :].reshape(40, H, D)
    assert_cache_rows_written(be.to_numpy(kc_d), be.to_numpy(vc_d), key, value, slots)


def test_bf16_rounding_is_nearest_even(be):
    vals = np.array([1.0, 1.00390625, 1.01171875, -3.3e38, 1e-40, 65504.0, np.inf, -np.inf], np.float32)
    key = be.asarray(np.tile(vals[:, None, None], (1, 1, 2)).astype(np.float32))
    kc = be.asarray(np.zeros((1, 8, 1, 2), BF16))
    vc = be.asarray(np.zeros((1, 8, 1, 2), BF16))
    be.reshape_and_cache(key, key, kc, vc, np.arange(8, dtype=np.int64))
    np.testing.assert_array_equal(be.to_numpy(kc)[0, :, 0, 0].view(np.uint16), vals.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("dtype,shape", [(np.float32, (10, 16, 3, 64)), (BF16, (10, 16, 2, 128)), (F16, (10, 1, 1, 3))])
def test_copy_blocks(be, dtype, shape):
    rng = np.random.default_rng(1)
    kcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    vcs = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(3)]
    kd, vd = [be.asarray(k) for k in kcs], [be.asarray(v) for v in vcs]
    mapping = np.array([[2, 7], [5, 1], [2, 9]], np.int64)
    exp_k, exp_v = copy_blocks_expected(kcs, mapping), copy_blocks_expected(vcs, mapping)
    be.copy_blocks(kd, vd, mapping)
    for layer in range(3):
        np.testing.assert_array_equal(be.to_numpy(kd[layer]).view(np.uint8), exp_k[layer].view(np.uint8))
        np.testing.assert_array_equal(be.to_numpy(vd[layer]).view(np.uint8), exp_v[layer].view(np.uint8))


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_dense_layers(be, act):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 576)).astype(np.float32).astype(act)
    res = rng.standard_normal((5, 576)).astype(np.float32).astype(act)
    w = rng.standard_normal(576).astype(np.float32)
    summed = (x.astype(np.float32) + res.astype(np.float32)).astype(act)
    res_d = be.asarray(res)
    out = f64(be.to_numpy(be.rms_norm(be.asarray(x), be.asarray(w), 1e-5, residual=res_d)))
    np.testing.assert_array_equal(np.asarray(be.to_numpy(res_d)).view(np.uint8), summed.view(np.uint8))
    np.testing.assert_allclose(out, rms_norm_ref(summed.astype(np.float32), w, 1e-5)[0], **tol(act))

    D = 64
    inv = 100000.0 ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(50)[:, None] * inv[None]
    cache = np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    pos = np.array([0, 3, 49, 7], np.int64)
    qkv = rng.standard_normal((4, 15 * D)).astype(np.float32).astype(act)
    qkv_d = be.asarray(qkv.copy())
    be.rotary_embedding(
        pos, qkv_d[:, : 9 * D].reshape(4, 9, D), qkv_d[:, 9 * D : 12 * D].reshape(4, 3, D), be.asarray(cache)
    )
    got = f64(be.to_numpy(qkv_d))
    for lo, hi, h in ((0, 9 * D, 9), (9 * D, 12 * D, 3)):
        a = f64(qkv[:, lo:hi]).reshape(4, h, D)
        cos = np.concatenate([np.cos(ang[pos])] * 2, -1)[:, None]
        sin = np.concatenate([np.sin(ang[pos])] * 2, -1)[:, None]
        rot = np.concatenate([-a[..., D // 2 :], a[..., : D // 2]], -1)
        np.testing.assert_allclose(got[:, lo:hi].reshape(4, h, D), a * cos + rot * sin, **tol(act))
    np.testing.assert_array_equal(got[:, 12 * D :], f64(qkv[:, 12 * D :]))

    g = rng.standard_normal((3, 600)).astype(np.float32).astype(act)
    gd = f64(g)
    np.testing.assert_allclose(
        f64(be.to_numpy(be.silu_and_mul(be.asarray(g)))),
        gd[:, :300] / (1 + np.exp(-gd[:, :300])) * gd[:, 300:],
        **tol(act),
    )


@cupy_only
@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_and_embedding(be, act, with_bias):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 96)).astype(np.float32).astype(act)
    w = rng.standard_normal((40, 96)).astype(np.float32).astype(act)
    b = rng.standard_normal(40).astype(np.float32).astype(act) if with_bias else None
    y = f64(be.to_numpy(be.linear(be.asarray(x), be.asarray(w), be.asarray(b) if with_bias else None)))
    ref = f64(x) @ f64(w).T + (f64(b) if with_bias else 0.0)
    loose = act != np.float32
    np.testing.assert_allclose(y, ref, rtol=2e-2 if loose else 1e-4, atol=5e-2 if loose else 1e-3)
    table = rng.standard_normal((50, 16)).astype(np.float32).astype(act)
    ids = np.array([3, 0, 49, 3], np.int64)
    rows = be.to_numpy(be.embedding(ids, be.asarray(table)))
    np.testing.assert_array_equal(np.asarray(rows).view(np.uint8), table[ids].view(np.uint8))


@pytest.mark.parametrize("act", [np.float32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 1000, 49152, 151936])
def test_sample(be, act, vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    logits[2] = np.round(logits[2])
    logits = logits.astype(act)
    args = sample_args(3, SAMPLE_CASES, rng)
    got = be.sample(be.asarray(logits), **args)
    assert_draws_match(got, logits.astype(np.float32), args)


@pytest.mark.parametrize("experts", ["float", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("act", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [3, 37], ids=["decode", "prefill"])
def test_moe_ops(be, T, act, experts):
    """One sparse block's four MoE ops on the device against the CPU backend: routing with ties (the same ids,
    the same weights), the alignment, the grouped product of float or GGUF experts on both paths (3 tokens
    x 2: a warp per weight row; 37 x 2: tiles) against float64, the combine with a shared expert."""
    from rawpaged.kernels.cpu.backend import CPUBackend
    from rawpaged.kernels.quantization import QuantizedExperts
    from rawpaged.testing.quant_blocks import random_blocks

    cpu = CPUBackend()
    rng = np.random.default_rng(T)
    E, k, H, N = 8, 2, 256, 96
    logits = rng.integers(-2, 3, (T, E)).astype(np.float32)
    ids, w = be.moe_route(be.asarray(logits), k, True, True)
    want_ids, want_w = cpu.moe_route(logits, k, True, True)
    np.testing.assert_array_equal(be.to_numpy(ids), want_ids)
    np.testing.assert_allclose(be.to_numpy(w), want_w, rtol=2e-7)
    sorted_ids, offsets = be.moe_align(ids, E)
    want_sorted, want_offsets = cpu.moe_align(want_ids, E)
    np.testing.assert_array_equal(be.to_numpy(sorted_ids), want_sorted)
    np.testing.assert_array_equal(be.to_numpy(offsets), want_offsets)
    if experts == "float":
        host = rng.standard_normal((E, N, H)).astype(np.float32).astype(act)
        handle, dense = be.load_experts([host], "bfloat16" if act == BF16 else "float32"), f64(host)
    else:
        if experts == "Q8_0":
            stack = QuantizedExperts.from_blocks("Q8_0", (E, N, H), _q8_0_blocks(rng, E * N, H).reshape(E, N, -1))
        else:
            stack = QuantizedExperts.from_blocks(
                "Q4_K", (E, N, H), random_blocks("Q4_K", E * N, H, rng, 0.1).reshape(E, N, -1)
            )
        handle, dense = be.load_experts([stack], "bfloat16" if act == BF16 else "float32"), f64(stack.dequantize())
    x = rng.standard_normal((T * k, H)).astype(np.float32).astype(act)
    y = f64(be.to_numpy(be.grouped_linear(be.asarray(x), offsets, handle)))
    ref = np.concatenate([f64(x[a:b]) @ dense[e].T for e, (a, b) in enumerate(zip(want_offsets, want_offsets[1:]))])
    loose = act != np.float32
    np.testing.assert_allclose(y, ref, rtol=2e-2 if loose else 1e-4, atol=(2e-2 if loose else 1e-4) * np.abs(ref).max())
    shared = rng.standard_normal((T, N)).astype(np.float32).astype(act)
    gate = rng.standard_normal((T, 1)).astype(np.float32)
    ys = y.astype(np.float32).astype(act)
    got = f64(be.to_numpy(be.moe_combine(be.asarray(ys), sorted_ids, w, T, be.asarray(shared), be.asarray(gate))))
    want = cpu.moe_combine(ys.astype(np.float32), want_sorted, want_w, T, shared.astype(np.float32), gate)
    np.testing.assert_allclose(got, want, rtol=1e-2 if loose else 1e-5, atol=1e-2 if loose else 1e-5)


def _q8_0_blocks(rng, rows, cols):
    """GGUF Q8_0 bytes uint8 ``[rows, cols / 32 * 34]``: an fp16 scale of about 0.01 and random int8 quants."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("act", [np.float32, BF16], ids=["f32", "bf16"])
def test_logprob_rows(be, act):
    """Prompt logprobs' device reduction of a 128-position chunk of the default model's vocabulary size: the
    CPU reduction's top ids, ranks and logprobs."""
    from rawpaged.kernels.cpu.logprobs import logprob_rows

    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((128, 49152)) * 3).astype(act)
    targets = rng.integers(0, 49152, 128)
    got = be.logprob_rows(be.asarray(logits), targets, 5)
    want = logprob_rows(logits.astype(np.float32), targets, 5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[0], want[0], atol=1e-4)
    np.testing.assert_allclose(got[3], want[3], atol=1e-4)


@cupy_only
def test_default_kv_cache_memory_within_device_memory(be):
    free, total = be.xp.cuda.runtime.memGetInfo()
    budget = be.default_kv_cache_memory(0.9)
    assert 0 < budget <= 0.9 * total
    assert be.default_kv_cache_memory(0.0) == 0


@cupy_only
def test_engine_on_cuda_matches_cpu_greedy(tmp_path):
    """The whole engine (loader, model, runner, kernels) on the device against the CPU engine."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.testing.random_model import write_random_model
    from rawpaged.tools.check_cuda_engine import classify_divergences

    model = write_random_model(
        tmp_path / "m",
        num_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=512,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 16, 17, 40)]
    kw = dict(model=str(model), num_kv_blocks=64, max_model_len=256)
    cpu_llm = LLM(device="cpu", **kw)
    cpu = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, params)]
    gpu_llm = LLM(device="cuda", dtype="float32", **kw)
    gpu = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, params)]
    # equal up to near-ties: random weights give near-uniform logits, whose top two float32 kernels that
    # sum in other orders may swap
    agreement = classify_divergences(cpu_llm, [p["prompt_token_ids"] for p in prompts], cpu, gpu)
    assert agreement["divergences"] == 0, agreement
    s = gpu_llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    bf16 = LLM(device="cuda", **kw)  # the CUDA default: bfloat16 weights, activations and KV cache
    assert (bf16.engine.dtype, bf16.engine.kv_cache_dtype) == ("bfloat16", "bfloat16")
    out = bf16.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    s = bf16.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize(
    "act,cache",
    [(np.float32, np.float32), (np.float32, BF16), (BF16, BF16), (F16, F16)],
    ids=["f32", "f32-bf16", "bf16", "f16"],
)
def test_rotary_embedding_and_cache_matches_the_cpu_composition(be, act, cache):
    """The fused RoPE + cache write on the device against the CPU's rotary_embedding + reshape_and_cache."""
    from tests.kv_reference import rope_cache

    rng = np.random.default_rng(5)
    num_blocks, block_size, Hq, H, D, T = 6, 16, 6, 2, 64, 20
    cos_sin = rope_cache(D, 300, 10000.0)
    pos = rng.integers(0, 300, T).astype(np.int64)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[[2, 11]] = -1
    qkv = rng.standard_normal((T, (Hq + 2 * H) * D)).astype(np.float32).astype(act)
    nan_cache = np.full((num_blocks, block_size, H, D), np.nan, np.float32).astype(cache)
    ref = qkv.astype(np.float32)  # a copy: the emulation's asarray shares host memory
    qkv_d, kc_d, vc_d = be.asarray(qkv), be.asarray(nan_cache), be.asarray(nan_cache.copy())
    q_d = qkv_d[:, : Hq * D].reshape(T, Hq, D)
    k_d = qkv_d[:, Hq * D : (Hq + H) * D].reshape(T, H, D)
    v_d = qkv_d[:, (Hq + H) * D :].reshape(T, H, D)
    be.rotary_embedding_and_cache(pos, q_d, k_d, v_d, kc_d, vc_d, slots, be.asarray(cos_sin))
    q, k, v = ref[:, : Hq * D].reshape(T, Hq, D), ref[:, Hq * D : (Hq + H) * D].reshape(T, H, D), ref[:, (Hq + H) * D :]
    kc, vc = np.full(nan_cache.shape, np.nan, np.float32), np.full(nan_cache.shape, np.nan, np.float32)
    cpu_cache.rotary_embedding_and_cache(pos, q, k, v.reshape(T, H, D), kc, vc, slots, cos_sin)
    t = dict(rtol=2e-2, atol=2e-2) if act != np.float32 or cache != np.float32 else dict(rtol=1e-5, atol=1e-5)
    got_q = be.to_numpy(qkv_d)[:, : Hq * D].astype(np.float32).reshape(T, Hq, D)
    np.testing.assert_allclose(got_q, q, **t)
    np.testing.assert_allclose(be.to_numpy(kc_d).astype(np.float32), kc, equal_nan=True, **t)
    np.testing.assert_allclose(be.to_numpy(vc_d).astype(np.float32), vc, equal_nan=True, **t)


@cupy_only
def test_cuda_graph_decode_matches_eager_and_the_cpu(tmp_path):
    """--no-enforce-eager on the device: a graph per size is captured, decode steps replay them, and the
    greedy ids equal the CPU engine's up to near-ties (float32), with every block returned."""
    from rawpaged import LLM, SamplingParams
    from rawpaged.testing.random_model import write_random_model
    from rawpaged.tools.check_cuda_engine import classify_divergences

    model = write_random_model(
        tmp_path / "m", num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64
    )
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 8, 12, 16, 20)]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 16, 17, 40, 5)]
    kw = dict(model=str(model), num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    cpu_llm = LLM(device="cpu", **kw)
    cpu_ids = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, params)]
    for dtype in ("float32", "bfloat16"):
        llm = LLM(device="cuda", dtype=dtype, enforce_eager=False, **kw)
        graphs = llm.engine.runner.cuda_graph
        assert sorted(graphs.graphs) == [1, 2, 4, 8]
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert [len(i) for i in ids] == [4, 8, 12, 16, 20]
        assert graphs.num_steps[8] > 0 and graphs.num_steps[1] > 0, graphs.num_steps
        if dtype == "float32":
            agreement = classify_divergences(cpu_llm, [p["prompt_token_ids"] for p in prompts], cpu_ids, ids)
            assert agreement["divergences"] == 0, agreement
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
