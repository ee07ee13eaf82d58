"""Launch geometry of the CUDA kernels (pure Python, mirrors of the constants in cuda/attention.cu), and the
GPU-less behaviour of the CUDA backend: weight staging over a fake CUDA API, dtype resolution."""

import ctypes
import types

import numpy as np
import pytest

from rawpaged.kernels.cuda import launch_config, program


@pytest.mark.parametrize("head_dim", program.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
def test_decode_config_covers_group_and_fits_shared_memory(head_dim, group):
    cfg = launch_config.decode_config(
        num_seqs=3, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, max_context_len=5000, num_sms=132
    )
    assert cfg["gmax"] in program.DECODE_GMAX and cfg["gmax"] <= program.gmax_cap(head_dim)
    assert cfg["gchunks"] * cfg["gmax"] >= group > (cfg["gchunks"] - 1) * cfg["gmax"]
    assert f"paged_attention_kernel<float, float, {head_dim}, {cfg['gmax']}>" in program.all_name_expressions()
    assert cfg["smem_bytes"] <= 48 * 1024, "decode must run without the shared-memory opt-in"
    assert cfg["num_splits"] * cfg["split_len"] >= 5000 > (cfg["num_splits"] - 1) * cfg["split_len"]
    assert cfg["grid"] == (2 * cfg["gchunks"], 3, cfg["num_splits"])


def test_decode_splits_fill_the_gpu_only_when_needed():
    one = launch_config.decode_config(1, 32, 8, 128, 4096, num_sms=132)
    assert one["num_splits"] > 1 and np.prod(one["grid"]) >= 132, "batch 1 must fill the SMs"
    assert one["split_len"] >= launch_config.MIN_SPLIT_TOKENS
    big = launch_config.decode_config(64, 32, 8, 128, 4096, num_sms=132)
    assert big["num_splits"] == 1, "512 (seq, kv-head) blocks already fill 132 SMs"
    short = launch_config.decode_config(1, 9, 3, 64, 100, num_sms=132)
    assert short["num_splits"] == 1, "a context shorter than one partition is never split"


def test_a_small_decode_grid_takes_shorter_partitions():
    """Batch 1 of the default model's heads (9/3) at 1024 tokens: 128-token partitions would give 24 blocks
    on 132 SMs; shorter ones (not below SMALL_GRID_MIN_SPLIT_TOKENS) fill most of them."""
    cfg = launch_config.decode_config(1, 9, 3, 64, 1024, num_sms=132)
    assert np.prod(cfg["grid"]) >= 96, cfg["grid"]
    assert launch_config.SMALL_GRID_MIN_SPLIT_TOKENS <= cfg["split_len"] < launch_config.MIN_SPLIT_TOKENS
    assert cfg["num_splits"] * cfg["split_len"] >= 1024
    eight = launch_config.decode_config(8, 9, 3, 64, 1024, num_sms=132)
    assert eight["split_len"] >= launch_config.MIN_SPLIT_TOKENS, "24 x 8 blocks fill the SMs at the usual length"


@pytest.mark.parametrize("head_dim", program.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 3, 6, 16, 80])
def test_prefill_config(head_dim, group):
    cfg = launch_config.prefill_config(2, 4 * group, 4, head_dim, max_query_len=100)
    rows = launch_config.prefill_rows(head_dim)
    assert 1 <= cfg["heads_per_block"] <= rows and cfg["tokens_per_tile"] * cfg["heads_per_block"] <= rows
    assert cfg["grid"][0] * cfg["tokens_per_tile"] >= 100
    assert cfg["smem_bytes"] <= 163 * 1024, "must fit the sm_80 opt-in limit"


def test_copy_word_and_threads():
    assert launch_config.copy_word_bytes(16 * 8 * 128 * 2) == 16
    assert launch_config.copy_word_bytes(36) == 4
    assert launch_config.copy_word_bytes(6) == 2
    assert launch_config.round_threads(576, 1024) == 576 and launch_config.round_threads(5, 1024) == 32
    assert launch_config.round_threads(4096, 1024) == 1024


def test_module_source_inlines_the_header_once():
    code = program.module_source()
    assert code.count("namespace rp {") >= 1 and '#include "common.cuh"' not in code
    for f in program.SOURCE_FILES:
        assert f"// ---- {f}" in code


def test_the_cuda_modules_do_not_import_cupy():
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, rawpaged.kernels.cuda.backend, rawpaged.kernels.cuda.program; "
            "assert 'cupy' not in sys.modules, 'cupy imported'",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr


def test_cuda_backend_without_gpu_raises_one_clear_line():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present")
    except Exception:
        pass
    from rawpaged.kernels.cuda.backend import CudaBackend

    with pytest.raises(RuntimeError, match=r"^no CUDA device found: ") as exc:
        CudaBackend()
    assert "\n" not in str(exc.value)


# ------------------------------------------------------------------------------------------ weight upload
class _FakeCuda:
    """The few CuPy calls PinnedStager makes, over host memory: memcpyAsync copies at once but records
    the order of events, so the test sees which buffer was refilled after which wait."""

    def __init__(self):
        self.log = []
        fake = self

        class Event:
            def __init__(self, n):
                self.n = n

            def synchronize(self):
                fake.log.append(("wait", self.n))

        class Stream:
            ptr = 7
            recorded = 0

            def record(self):
                Stream.recorded += 1
                return Event(Stream.recorded)

        class Runtime:
            @staticmethod
            def memcpyAsync(dst, src_ptr, n, kind, stream):
                assert kind == 1 and stream == 7
                ctypes.memmove(dst, src_ptr, n)
                fake.log.append(("copy", n))

        self.stream = Stream()
        self.cuda = types.SimpleNamespace(
            alloc_pinned_memory=lambda n: bytearray(n), get_current_stream=lambda: self.stream, runtime=Runtime
        )


class _HostArray:
    """A NumPy array with CuPy's ``.data.ptr`` (the stager only needs the address)."""

    def __init__(self, a):
        self.a = a
        self.nbytes = a.nbytes
        self.flags = a.flags
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)


def test_pinned_stager_copies_in_chunks_through_two_alternating_buffers():
    from rawpaged.kernels.cuda.weights import PinnedStager

    fake = _FakeCuda()
    stager = PinnedStager(fake, chunk_bytes=1000)
    host = np.random.default_rng(0).standard_normal((37, 29)).astype(np.float32)  # 4292 bytes: 5 chunks
    dst = np.full((37, 29), np.nan, np.float32)
    stager.copy(_HostArray(dst), host)
    np.testing.assert_array_equal(dst, host)
    assert [n for kind, n in fake.log if kind == "copy"] == [1000, 1000, 1000, 1000, 292]
    # Chunk 3 reuses buffer 0: it must wait for chunk 1's event (1) first, chunk 4 for event 2, ...
    assert [n for kind, n in fake.log if kind == "wait"] == [1, 2, 3]
    assert fake.log.index(("wait", 1)) < [i for i, e in enumerate(fake.log) if e[0] == "copy"][2]
    dst2 = np.zeros(10, np.float16)
    stager.copy(_HostArray(dst2), np.arange(10, dtype=np.float16))
    np.testing.assert_array_equal(dst2, np.arange(10))
    with pytest.raises(ValueError, match="bytes"):
        stager.copy(_HostArray(np.zeros(3, np.float32)), np.zeros(4, np.float32))
    stager.close()
    assert stager.bytes_copied == host.nbytes + 20


# ------------------------------------------------------------------------------------------ dtypes
def test_dtype_auto_resolution_and_unsupported_pairs():
    from rawpaged.config import resolve_dtypes
    from rawpaged.kernels.cpu.backend import CPUBackend
    from rawpaged.kernels.cuda.backend import CudaBackend

    cpu, cuda = CPUBackend, CudaBackend  # the class attributes resolution reads need no device
    assert resolve_dtypes("auto", "auto", cpu, "bfloat16") == ("float32", "float32")
    assert resolve_dtypes("auto", "bfloat16", cpu, None) == ("float32", "bfloat16")
    assert resolve_dtypes("auto", "auto", cuda, "float32") == ("bfloat16", "bfloat16")
    assert resolve_dtypes("auto", "auto", cuda, "float16") == ("float16", "float16")
    assert resolve_dtypes("float32", "auto", cuda, "bfloat16") == ("float32", "float32")
    with pytest.raises(ValueError, match="dtype 'bfloat16' is not supported on the cpu backend"):
        resolve_dtypes("bfloat16", "auto", cpu, None)
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' with dtype 'bfloat16'"):
        resolve_dtypes("bfloat16", "float32", cuda, None)
    names = {"float32": program.F32, "float16": program.F16, "bfloat16": program.BF16}
    assert names == {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
    names |= {"int8": "signed char", "fp8_e4m3": "rp::fp8_e4m3"}  # quantized caches: their storage types
    assert {(names[a], names[c]) for a, c in CudaBackend.dtype_pairs} == set(program.DTYPE_PAIRS)
    assert resolve_dtypes("bfloat16", "fp8", cuda, None) == ("bfloat16", "fp8_e4m3")
    assert resolve_dtypes("auto", "int8", cpu, None) == ("float32", "int8")


def test_attention_refuses_a_block_size_that_is_not_a_power_of_two():
    """The kernels split positions into block and row with a shift and a mask."""
    from rawpaged.kernels.cuda.backend import CudaBackend

    be = CudaBackend._with_launcher(np, lambda *a: pytest.fail("launched"), lambda a: a.ctypes.data, num_sms=4)
    q = np.zeros((1, 4, 64), np.float32)
    cache = np.zeros((4, 12, 2, 64), np.float32)
    bt, ctx = np.zeros((1, 2), np.int32), np.array([5], np.int32)
    with pytest.raises(ValueError, match="power of two"):
        be.paged_attention(np.empty_like(q), q, cache, cache.copy(), bt, ctx, 0.125)
    with pytest.raises(ValueError, match="power of two"):
        be.prefill_attention(np.empty_like(q), q, cache, cache.copy(), bt, np.array([0, 1], np.int32), ctx, 0.125)


def test_sampling_stages_a_row_in_shared_memory_only_beside_the_static_arrays():
    """The opt-in maximum bounds static plus dynamic shared memory together: on Hopper (227 KiB) a
    vocabulary of 57.8k-58.1k fits the probabilities alone but not with the kernel's ~1.3 KB of scratch."""
    hopper = 227 * 1024
    static = launch_config.SAMPLE_STATIC_SMEM_BYTES
    assert 1024 < static < 2048
    assert launch_config.sample_smem_bytes(49152, hopper) == 4 * 49152  # the default model: staged
    assert launch_config.sample_smem_bytes(58000, hopper) == 0  # 232000 bytes fit 232448, but not with the scratch
    fits = (hopper - static) // 4
    assert launch_config.sample_smem_bytes(fits, hopper) == 4 * fits and 4 * fits + static <= hopper
    assert launch_config.sample_smem_bytes(fits + 1, hopper) == 0
    assert launch_config.sample_smem_bytes(100, 400, static_smem_bytes=0) == 400  # what the driver reports decides
    assert launch_config.sample_smem_bytes(100, 400, static_smem_bytes=1) == 0
