"""The CUDA mixture-of-experts kernels (cuda/moe.cu, the grouped products of cuda/quant.cu) run in the CPU
emulation (tests/cuda_emu) through the real runtime code (``CudaBackend`` over NumPy arrays), against the
CPU backend's MoE ops and float64 products: routing with ties in each normalization, the stable alignment
(experts with no rows, more ids than a staged chunk, more experts than a block's threads), grouped products
of float experts in each activation dtype and of GGUF experts (Q8_0, Q4_K, Q6_K, a fused gate/up of two
formats) on both paths (one warp per weight row, and tiles), where an expert with no rows is poisoned with
NaN and must not show, the weighted combine with and without a shared expert, and whole MoE models through
the engine against the CPU engine's greedy tokens (safetensors and Q8_0 GGUF experts)."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cuda import launch_config, program
from rawpaged.kernels.cuda.moe import DeviceQuantizedExperts, DeviceStackedExperts
from rawpaged.kernels.quantization import QuantizedExperts, QuantizedTensor
from rawpaged.testing.quant_blocks import random_blocks
from tests.cuda_emu import Emulator, build, emulated_backend, missing_requirements
from tests.kv_reference import BF16

_why = missing_requirements()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"CUDA emulation unavailable: {_why}")

CPU = CPUBackend()
ACTS = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
#: fp16 NaN bits, little-endian bytes: the poison of a quantized expert's scales
NAN_F16 = 0x7E00


@pytest.fixture(scope="module")
def emu():
    return Emulator(build())


class _PoisonedNumpy:
    """NumPy whose ``empty`` is NaN-filled (bf16/fp16 bits too), so an output element no kernel writes shows."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=np.float32):
        a = np.empty(shape, dtype=dtype)
        if a.dtype == np.uint16:
            a.fill(0x7FC0)
        elif a.dtype.kind == "f":
            a.fill(np.nan)
        return a


def _backend(emu):
    be = emulated_backend(emu, num_sms=4)
    be.xp = _PoisonedNumpy()
    return be


def _dev(a):
    return a.view(np.uint16) if a.dtype == BF16 else a


def _host(a, dtype):
    return np.asarray(a).view(BF16) if dtype == BF16 else np.asarray(a)


def _launched(emu) -> list:
    return [n.split("<")[0] for n, *_ in emu.launches]


# ------------------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("before,renorm", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("E,k", [(8, 3), (128, 8), (6, 6)])
def test_route_equals_the_cpu_kernel_with_ties(emu, before, renorm, E, k):
    """Integer logits (many ties, whole rows equal) and random ones: the same experts in the same order as
    the CPU kernel (the lower index first among equal values) and the same float32 weights."""
    rng = np.random.default_rng(E * 10 + k)
    logits = rng.integers(-2, 3, (150, E)).astype(np.float32)
    logits[::2] += rng.standard_normal((75, E)).astype(np.float32) * 3
    logits[5] = 1.5
    be = _backend(emu)
    emu.launches.clear()
    ids, w = be.moe_route(logits, k, before, renorm)
    assert _launched(emu) == ["moe_route_kernel"]
    want_ids, want_w = CPU.moe_route(logits, k, before, renorm)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == (150, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(ids[5], np.arange(k))
    np.testing.assert_allclose(w, want_w, rtol=2e-7, atol=0)


def test_route_refuses_k_beyond_the_experts(emu):
    with pytest.raises(ValueError, match="top_k 5"):
        _backend(emu).moe_route(np.zeros((2, 4), np.float32), 5, True, False)


# ------------------------------------------------------------------------------------------ alignment
@pytest.mark.parametrize("T,k,E", [(3, 2, 6), (700, 2, 40), (1, 8, 128), (25, 2, 1030), (0, 2, 4)])
def test_align_equals_the_cpu_kernel(emu, T, k, E):
    """A stable sort by expert with offsets: experts with no rows (every even one of the first ten), more ids
    than one staged chunk (700 x 2 > 1024), more experts than a block's 1024 threads, no tokens at all."""
    rng = np.random.default_rng(T + E)
    ids = rng.integers(0, E, (T, k)).astype(np.int32)
    ids[(ids < 10) & (ids % 2 == 0)] += 1
    sorted_ids, offsets = _backend(emu).moe_align(ids, E)
    want_ids, want_offsets = CPU.moe_align(ids, E)
    assert sorted_ids.dtype == np.int32 and offsets.dtype == np.int64
    np.testing.assert_array_equal(offsets, want_offsets)
    np.testing.assert_array_equal(sorted_ids, want_ids)


# ------------------------------------------------------------------------------------------ grouped products
#: expert offsets over 5 experts, experts 2 and 4 without rows: a decode-like step (the warp-per-row tiles)
#: and a prefill-like one (tiles of QG_BM rows; expert 3 spans two tiles, the second partial)
OFFSETS = {"gemv": np.array([0, 2, 3, 3, 9, 9]), "gemm": np.array([0, 1, 1, 1, 45, 45])}
KERNELS = {"gemv": "moe_gemv_kernel", "gemm": "moe_gemm_kernel"}


def _rows_ref(x, offsets, w):
    """float64 ``x[r] @ w[e].T`` for each expert's rows."""
    out = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        r0, r1 = offsets[e], offsets[e + 1]
        out[r0:r1] = x[r0:r1].astype(np.float64) @ w[e].astype(np.float64).T
    return out


@pytest.mark.parametrize("path", list(OFFSETS))
@pytest.mark.parametrize("act", list(ACTS))
def test_grouped_linear_float_experts(emu, act, path):
    """Float experts stored in the activation dtype (K = 40, N = 70: partial blocks and tiles), gate/up
    parts fused, x with a row stride; the experts without rows are NaN and no output shows it."""
    a_np = ACTS[act]
    rng = np.random.default_rng(3)
    E, N, K = 5, 70, 40
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    w[2] = w[4] = np.nan
    be = _backend(emu)
    experts = be.load_experts([w[:, :30].astype(a_np), w[:, 30:]], act)
    assert experts.shape == (E, N, K) and experts.dtype == (np.uint16 if a_np == BF16 else a_np)
    offsets = OFFSETS[path]
    M = int(offsets[-1])
    wide = rng.standard_normal((M, 64)).astype(np.float32).astype(a_np)
    x = wide[:, :K]
    emu.launches.clear()
    got = _host(be.grouped_linear(_dev(x), offsets, experts), a_np).astype(np.float64)
    assert _launched(emu) == ["moe_tiles_kernel", KERNELS[path]]
    assert got.shape == (M, N) and not np.isnan(got).any()
    want = _rows_ref(x, offsets, w.astype(a_np))
    tol = 1e-5 if a_np == np.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    if a_np == np.float32:
        cpu = CPU.grouped_linear(x, offsets, CPU.load_experts([w], "float32"))
        np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5)


def _quantized_stack(qtype, E, N, K, rng, poisoned=(2, 4)):
    """A random ``QuantizedExperts`` of ``qtype`` whose experts ``poisoned`` have NaN scales."""
    if qtype == "Q8_0":
        w = rng.standard_normal((E, N, K)).astype(np.float32)
        stack = QuantizedExperts.stack([QuantizedTensor.quantize(w[e], qtype) for e in range(E)])
        for e in poisoned:
            stack.scales[e] = NAN_F16
        return stack
    per, size = {"Q4_K": (256, 144), "Q6_K": (256, 210)}[qtype]
    data = random_blocks(qtype, E * N, K, rng, 0.1).reshape(E, N, K // per, size)
    d_at = 0 if qtype == "Q4_K" else 208  # the super-block's fp16 scale d
    for e in poisoned:
        data[e, :, :, d_at : d_at + 2] = np.frombuffer(np.uint16(NAN_F16).tobytes(), np.uint8)
    return QuantizedExperts.from_blocks(qtype, (E, N, K), data.reshape(E, N, -1))


def _dequantized_rows(stack, poisoned=(2, 4)):
    """float64 ``[E, N, K]`` of ``stack``, the poisoned experts' rows left at 0 (they have no rows)."""
    return np.stack(
        [
            np.zeros(stack.shape[1:]) if e in poisoned else stack.expert(e).dequantize().astype(np.float64)
            for e in range(stack.shape[0])
        ]
    )


@pytest.mark.parametrize("path", list(OFFSETS))
@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtypes", [("Q8_0",), ("Q4_K",), ("Q6_K",), ("Q4_K", "Q6_K")], ids="+".join)
def test_grouped_linear_quantized_experts(emu, qtypes, act, path):
    """GGUF experts in their blocks: the gate and up stacks fused (one format: one stack; two: a
    DeviceStackedExperts computed part by part), against float64 products of the dequantized experts and
    the CPU backend's integer path; experts 2 and 4 have no rows and NaN scales."""
    a_np = ACTS[act]
    rng = np.random.default_rng(len(qtypes) * 7 + len(qtypes[0]))
    E, N, K = 5, 24, 256 if "Q8_0" not in qtypes else 96
    parts = [_quantized_stack(q, E, N, K, rng) for q in (qtypes * 2)[:2]]
    be = _backend(emu)
    experts = be.load_experts(parts, act)
    kind = DeviceStackedExperts if len(qtypes) > 1 else DeviceQuantizedExperts
    assert isinstance(experts, kind) and experts.shape == (E, 2 * N, K)
    offsets = OFFSETS[path]
    M = int(offsets[-1])
    x = rng.standard_normal((M, K)).astype(np.float32).astype(a_np)
    emu.launches.clear()
    got = _host(be.grouped_linear(_dev(x), offsets, experts), a_np).astype(np.float64)
    assert set(_launched(emu)) == {"moe_tiles_kernel", f"moe_quant_{path}_kernel"}
    assert got.shape == (M, 2 * N) and not np.isnan(got).any()
    want = _rows_ref(x, offsets, np.concatenate([_dequantized_rows(p) for p in parts], axis=1))
    tol = 1e-5 if a_np == np.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    if a_np == np.float32:  # the CPU quantizes the activations of its integer path: its own rounding
        cpu = CPU.grouped_linear(x, offsets, CPU.load_experts(parts, "float32"))
        np.testing.assert_allclose(got, cpu, rtol=0, atol=2e-2 * np.abs(want).max())


def test_the_tile_sizes_instantiated_are_the_products_tiles():
    assert program.MOE_TILE_ROWS == (launch_config.QUANT_GEMV_MAX_M, launch_config.QG_BM)


@pytest.mark.parametrize("bm", program.MOE_TILE_ROWS)
def test_row_tiles_cover_the_experts_with_rows_only(emu, bm):
    """The grouped products' blocks come from this list (blocks past its count return before reading a
    weight): every row of each expert with rows in exactly one tile, no tile for an expert without rows."""
    from rawpaged.kernels.cuda.moe import row_tiles

    counts = np.array([0, 3, 0, 0, 41, 8, 9, 0, 1, 0])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    M, E = int(offsets[-1]), len(counts)
    be = _backend(emu)
    tiles = row_tiles(be.ctx, "float", offsets, bm, -(-M // bm) + min(E, M))
    n = int(tiles[0])
    listed = [(int(tiles[1 + 2 * t]), int(tiles[2 + 2 * t])) for t in range(n)]
    want = [(e, r) for e in range(E) for r in range(0, counts[e], bm)]
    assert listed == want and n <= -(-M // bm) + min(E, M)


def test_grouped_linear_refuses_what_does_not_fit(emu):
    be = _backend(emu)
    experts = be.load_experts([np.zeros((3, 8, 32), np.float32)], "float32")
    with pytest.raises(ValueError, match="does not fit"):
        be.grouped_linear(np.zeros((2, 16), np.float32), np.array([0, 2, 2, 2]), experts)
    with pytest.raises(ValueError, match="expert_offsets"):
        be.grouped_linear(np.zeros((2, 32), np.float32), np.array([0, 2]), experts)
    with pytest.raises(ValueError, match="one E and one K"):
        be.load_experts([np.zeros((3, 8, 32)), np.zeros((2, 8, 32))], "float32")


# ------------------------------------------------------------------------------------------ combine
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_combine_equals_the_cpu_kernel(emu, act, with_shared):
    """Each token's k rows weighted and summed in slot order (plus Qwen2-MoE's gated shared expert), against
    the CPU kernel on the same rounded inputs."""
    a_np = ACTS[act]
    rng = np.random.default_rng(9)
    T, k, E, H = 13, 3, 6, 72
    sorted_ids, _ = CPU.moe_align(rng.integers(0, E, (T, k)).astype(np.int32), E)
    y = rng.standard_normal((T * k, H)).astype(np.float32).astype(a_np)
    w = rng.random((T, k)).astype(np.float32)
    shared = rng.standard_normal((T, H)).astype(np.float32).astype(a_np) if with_shared else None
    gate = rng.standard_normal((T, 1)).astype(np.float32) * 3 if with_shared else None
    emu.launches.clear()
    got = _backend(emu).moe_combine(_dev(y), sorted_ids, w, T, None if shared is None else _dev(shared), gate)
    assert _launched(emu) == ["moe_invert_kernel", "moe_combine_kernel"]
    got = _host(got, a_np).astype(np.float32)
    want = CPU.moe_combine(
        y.astype(np.float32), sorted_ids, w, T, None if shared is None else shared.astype(np.float32), gate
    )
    if a_np == np.float32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # one rounding to the dtype at the end
        np.testing.assert_allclose(got, want.astype(a_np).astype(np.float32), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------ the engine
def _engines(emu, monkeypatch, model, **kw):
    """The CPU engine and, with the emulated CUDA backend, a float32 and a bfloat16 one of ``model``."""
    from rawpaged import LLM
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.kernels.cuda import linear as cuda_linear
    from tests.kernels.test_cuda_emulated import _numpy_linear_bf16

    kw = dict(model=str(model), num_kv_blocks=64, block_size=16, max_model_len=256, **kw)
    cpu = LLM(device="cpu", **kw)
    monkeypatch.setattr(cuda_linear, "linear_bf16", _numpy_linear_bf16)
    monkeypatch.setattr(engine_mod, "get_backend", lambda device: emulated_backend(emu, num_sms=4))
    return cpu, LLM(device="cuda", dtype="float32", **kw), LLM(device="cuda", **kw)


def _moe_layers(llm) -> list:
    return [layer["moe"] for layer in llm.engine.model.layers if "moe" in layer]


def _check_engines(emu, cpu, f32, bf16, quantized: bool):
    """float32 on the emulated kernels gives the CPU engine's greedy ids, batched and with a prefix hit, every
    block back; bfloat16's first-step logits are within its precision."""
    from rawpaged import SamplingParams
    from rawpaged.tools.check_cuda_engine import _first_logits
    from tests.model_executor.test_moe import PROMPTS

    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, greedy)]
    emu.launches.clear()
    assert [o.outputs[0].token_ids for o in f32.generate(prompts, greedy)] == want
    assert [o.outputs[0].token_ids for o in f32.generate(prompts[4:], greedy)] == want[4:]  # prefix hits
    stats = f32.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["prefix_cache_hits"] > 0
    launched = set(_launched(emu))
    grouped = {"moe_quant_gemv_kernel", "moe_quant_gemm_kernel"} if quantized else {"moe_gemv_kernel"}
    assert {"moe_route_kernel", "moe_align_kernel", "moe_tiles_kernel", "moe_combine_kernel"} | grouped <= launched
    for p in PROMPTS[:3]:
        ref = _first_logits(cpu, p)
        got = _first_logits(bf16, p)
        assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref)) + 1e-3


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_moe_engine_on_emulated_cuda_matches_the_cpu_engine(emu, tmp_path, monkeypatch, arch):
    """Each architecture's random safetensors checkpoint (``MOE_SHAPES``, head_dim 64 as the CUDA attention
    kernels are built for): float experts on the device."""
    from rawpaged.testing.random_model import MOE_SHAPES, write_random_model
    from tests.model_executor.test_moe import STD

    model = write_random_model(tmp_path / arch, weight_std=STD, **dict(MOE_SHAPES[arch], head_dim=64))
    cpu, f32, bf16 = _engines(emu, monkeypatch, model)
    assert all(isinstance(m.gate_up, np.ndarray) for m in _moe_layers(f32))
    _check_engines(emu, cpu, f32, bf16, quantized=False)


def test_moe_gguf_engine_with_q8_0_experts_on_emulated_cuda(emu, tmp_path, monkeypatch):
    """Qwen2-MoE (shared expert, a dense layer) as a GGUF with Q8_0 experts: the experts stay in their
    blocks on the device (``DeviceQuantizedExperts``) and the greedy ids are the CPU engine's on the file."""
    pytest.importorskip("gguf")
    from rawpaged.testing.random_model import MOE_Q8_SHAPES, write_random_model
    from rawpaged.testing.random_moe_gguf import write_moe_gguf
    from tests.model_executor.test_moe import STD

    arch = "Qwen2MoeForCausalLM"
    hf = write_random_model(tmp_path / arch, weight_std=STD, **dict(MOE_Q8_SHAPES[arch], head_dim=64))
    path = write_moe_gguf(hf, tmp_path / "q8.gguf", expert_type="Q8_0")
    cpu, f32, bf16 = _engines(emu, monkeypatch, path)
    assert all(isinstance(m.gate_up, DeviceQuantizedExperts) and m.gate_up.qtype == "Q8_0" for m in _moe_layers(f32))
    _check_engines(emu, cpu, f32, bf16, quantized=True)


def test_the_device_checks_moe_shape_runs_on_the_emulated_kernels(emu, tmp_path, monkeypatch):
    """rawpaged/tools/check_cuda_engine.py's check of a mixture of experts (scripts/gpu_check.sh's engine-moe
    stage) end to end on a small version of its Qwen2-MoE shape, so a device session is never spent on a
    broken check."""
    from rawpaged.engine import llm_engine as engine_mod
    from rawpaged.kernels.cuda import linear as cuda_linear
    from rawpaged.tools import check_cuda_engine
    from tests.kernels.test_cuda_emulated import _numpy_linear_bf16

    real = engine_mod.get_backend
    monkeypatch.setattr(cuda_linear, "linear_bf16", _numpy_linear_bf16)
    monkeypatch.setattr(
        engine_mod, "get_backend", lambda device: emulated_backend(emu, num_sms=4) if device == "cuda" else real(device)
    )
    shape = dict(check_cuda_engine.MOE_CHECK_SHAPES["qwen2-moe-head64"], num_layers=1, hidden_size=128, num_heads=2,
                 num_kv_heads=1, vocab_size=259, num_experts=4, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64)  # fmt: skip
    r = check_cuda_engine.check_shape(
        "tiny-moe", shape, tmp_path, np.random.default_rng(0), prompt_lens=(3, 17), max_tokens=3, timing_batches=()
    )
    assert r["ok"], r
    assert r["float32"]["ids_equal"] == 2 and r["float32"]["max_abs_logit_diff"] < 1e-4
    assert "moe_combine_kernel" in _launched(emu)


def test_moe_kernels_have_no_data_races_under_tsan(tmp_path):
    """The alignment (two passes over staged chunks between barriers), both grouped-product paths (the
    tiles' shared memory) and the combine, replayed under ThreadSanitizer, compute what they computed."""
    from tests.cuda_emu import read_replay_output
    from tests.kernels.test_cuda_emulated import _replay_under_tsan

    names = ["moe_route_kernel<float>", "moe_align_kernel<1024>", "moe_tiles_kernel<8>", "moe_tiles_kernel<32>",
             "moe_gemv_kernel<float>", "moe_quant_gemm_kernel<float, 0>", "moe_invert_kernel<int>",
             "moe_combine_kernel<float>"]  # fmt: skip

    def record(rec):
        be = emulated_backend(rec, num_sms=4)
        rng = np.random.default_rng(0)
        T, E, k, K = 40, 6, 2, 64
        ids, w = be.moe_route(rng.standard_normal((T, E)).astype(np.float32), k, True, True)
        sorted_ids, offsets = be.moe_align(ids, E)
        x = rng.standard_normal((T * k, K)).astype(np.float32)
        be.grouped_linear(x[:8], np.array([0, 3, 3, 8, 8, 8, 8]), be.load_experts([x[:30].reshape(6, 5, K)], "float32"))
        stack = QuantizedExperts.stack([QuantizedTensor.quantize(x[e : e + 4], "Q8_0") for e in range(E)])
        y = be.grouped_linear(x, offsets, be.load_experts([stack], "float32"))
        be.moe_combine(y, sorted_ids, w, T, y[:T], rng.standard_normal((T, 1)).astype(np.float32))

    rec, r = _replay_under_tsan(names, record, tmp_path)
    assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, r.stderr[-6000:]
    assert read_replay_output(tmp_path / "out.bin") == rec.final(), "the TSan replay computed different results"
